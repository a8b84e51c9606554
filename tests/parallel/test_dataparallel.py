"""strategy=dataparallel: classic single-process nn.DataParallel, and what it says where it cannot spread."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from meshkit import Engine
from meshkit.parallel.compose import unwrap
from meshkit.parallel.dataparallel import DataParallelError, apply_dataparallel, check_world, dataparallel_devices


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator), torch.randn(8, 2, generator=generator)) for _ in range(4)]


def test_on_a_host_without_accelerators_it_runs_as_one_process_and_says_so(capsys) -> None:
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in _batches():
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    with Engine(strategy="dataparallel", hang_doctor=False) as engine:
        model = _model()
        model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in _batches():
            loss = nn.functional.mse_loss(model(x), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        weights = engine.full_state_dict()
    said = capsys.readouterr().out
    assert "strategy=dataparallel on a host with no accelerator" in said and "running as one process" in said
    assert said.count("strategy=dataparallel") == 1  # one line
    assert not isinstance(model, nn.DataParallel)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(weights[name], tensor), name


def test_a_data_parallel_model_is_taken_as_asked_without_a_warning() -> None:
    inner = _model()
    with Engine(strategy="dataparallel", hang_doctor=False) as engine, warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = engine.prepare(nn.DataParallel(inner))
    assert unwrap(prepared) is inner


def test_more_than_one_process_is_refused_in_one_line() -> None:
    with pytest.raises(DataParallelError, match=r"one process over its local devices.*nproc_per_node=1") as caught:
        check_world(2)
    assert "\n" not in str(caught.value)
    check_world(1)


def test_devices_and_the_wrapper() -> None:
    assert dataparallel_devices(torch.device("cpu")) == []
    model, notice = apply_dataparallel(_model(), torch.device("cpu"))
    assert not isinstance(model, nn.DataParallel) and notice is not None
    assert unwrap(nn.DataParallel(model)) is model  # checkpoints and exports see the bare module's names
