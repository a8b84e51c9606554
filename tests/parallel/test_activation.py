"""Activation checkpointing and offload: same numbers as without, fewer bytes kept, clear errors."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from meshkit import Engine
from meshkit.config import RunConfig
from meshkit.core.errors import MeshkitError
from meshkit.models.gpt import GPT, GPTConfig, lm_loss
from meshkit.parallel.activation import ActivationOffloadNotice
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.training import make_optimizer, split, tiny_gpt, token_batches

MODES = {
    "full": {"activation_checkpointing": {"mode": "full"}},
    "selective": {"activation_checkpointing": {"mode": "selective"}},
    "every-2": {"activation_checkpointing": {"mode": "full", "every": 2}},
    "selective every-2": {"activation_checkpointing": {"mode": "selective", "every": 2}},
    "offload": {"activation_offload": True},
    "full+offload": {"activation_checkpointing": {"mode": "full"}, "activation_offload": True},
}
STEPS = 3


def run(overrides: dict, rank: int = 0, world: int = 1) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """Losses, first-step gradients and final weights (full tensors) of a short hand-written loop."""
    notice = pytest.warns(ActivationOffloadNotice) if overrides.get("activation_offload") else nullcontext()
    with Engine(seed=0, **overrides) as engine:
        model = tiny_four_blocks()
        with notice:
            model, optimizer = engine.prepare(model, make_optimizer(model))
        local = 4 // world
        losses, first_grads = [], {}
        for step, batch in enumerate(token_batches(STEPS, 4)):
            inputs, targets = split(batch[rank * local : (rank + 1) * local])
            loss = lm_loss(model(inputs), targets)
            engine.backward(loss)
            if step == 0:
                first_grads = {name: _full(p.grad).clone() for name, p in engine.unwrap_model().named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(engine.reduce(loss.detach()).item())
        return losses, first_grads, engine.full_state_dict()


def tiny_four_blocks() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def assert_same_run(actual: tuple, expected: tuple, tol: float = 1e-6, label: str = "") -> None:
    losses, grads, state = actual
    expected_losses, expected_grads, expected_state = expected
    for step, (a, e) in enumerate(zip(losses, expected_losses, strict=True)):
        assert abs(a - e) <= tol * abs(e), f"{label} step {step}: loss {a} vs {e}"
    for kind, got, want in (("gradient", grads, expected_grads), ("weight", state, expected_state)):
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            err = ((got[name] - tensor).norm() / tensor.norm().clamp_min(1e-12)).item()
            assert err <= tol, f"{label} {kind} {name}: relative error {err:.2e}"


@pytest.fixture(scope="module")
def unchecked() -> tuple:
    return run({})


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_matches_no_checkpointing(mode: str, unchecked: tuple) -> None:
    assert_same_run(run(MODES[mode]), unchecked, label=mode)


def fsdp_modes(rank: int) -> dict[str, tuple]:
    torch.distributed.init_process_group("gloo")  # one group for every engine of this world
    sharded = {"zero_stage": 3, "hang_doctor": False}
    results = {"none": run(sharded, rank, 2)}
    for mode in ("full", "selective", "every-2", "full+offload"):
        results[mode] = run({**sharded, **MODES[mode]}, rank, 2)
    prefetch = {"sharding": {"zero_stage": 3, "forward_prefetch": 2, "backward_prefetch": 1}}
    results["selective+prefetch"] = run({"hang_doctor": False, **prefetch, **MODES["selective"]}, rank, 2)
    leave_world()
    return results


def test_every_mode_matches_no_checkpointing_under_fsdp() -> None:
    for results in run_world(fsdp_modes, 2, timeout=240):
        for mode, result in results.items():
            assert_same_run(result, results["none"], label=mode)


def losses_of(kind: str, overrides: dict) -> tuple[list[float], list[str]]:
    """Losses of a few train steps, and the blocks the activation report saw checkpointed."""
    from tests.helpers.layouts import build

    with Engine(seed=0, **overrides) as engine:
        model = build(kind)
        engine.prepare(model, make_optimizer(model), loss_fn=lm_loss)
        batches = [split(batch) for batch in token_batches(STEPS, 4)]
        with engine.activation_report() as report:
            losses = [engine.train_step(batches[0]).item()]
        losses += [engine.train_step(batch).item() for batch in batches[1:]]
        return losses, report.as_dict()["checkpointed_blocks"]


@pytest.mark.parametrize("kind", ["hf", "gpt2"])
def test_models_with_other_block_names_are_checkpointed_too(kind: str) -> None:
    """Hugging Face-style decoders (`layers`, and GPT-2's `h` with biased linears: `addmm` under selective)."""
    plain, none_checkpointed = losses_of(kind, {})
    assert none_checkpointed == []
    for mode in ("full", "selective"):
        losses, checkpointed = losses_of(kind, MODES[mode])
        assert len(checkpointed) == 2, (mode, checkpointed)
        assert all(abs(a - e) <= 1e-6 * abs(e) for a, e in zip(losses, plain, strict=True)), (mode, kind)


# ---------------------------------------------------------------- measured bytes

REPORT_MODEL = GPTConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, max_seq_len=64)
BATCH, SEQ = 2, 64


def report_for(overrides: dict) -> dict:
    with Engine(seed=0, **overrides) as engine:
        torch.manual_seed(0)
        model = GPT(REPORT_MODEL)
        engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lm_loss)
        tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        with engine.activation_report() as report:
            engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        return report.as_dict()


def test_saved_bytes_fall_none_selective_full() -> None:
    none, selective, full = (report_for(MODES.get(m, {})) for m in ("none", "selective", "full"))
    assert none["peak_bytes"] > selective["peak_bytes"] > full["peak_bytes"]
    assert none["blocks_saved_bytes"] > selective["blocks_saved_bytes"] > full["blocks_saved_bytes"]
    assert set(none["blocks"]) == {f"layers.{i}" for i in range(4)}
    assert full["checkpointed_blocks"] == [f"layers.{i}" for i in range(4)]


def test_full_keeps_one_input_per_block_plus_one_recomputed_block() -> None:
    none, full = report_for({}), report_for(MODES["full"])
    block_input = BATCH * SEQ * REPORT_MODEL.dim * 4  # fp32 hidden states entering each block
    one_block = max(block["saved_bytes"] for block in none["blocks"].values())
    expected = REPORT_MODEL.n_layers * block_input + one_block
    measured = full["blocks_saved_bytes"] + full["recompute_peak_bytes"]
    assert abs(measured - expected) <= 0.1 * expected, (measured, expected)


def test_offload_counts_the_same_bytes() -> None:
    none = report_for({})
    with pytest.warns(ActivationOffloadNotice):
        offload = report_for({"activation_offload": True})
    assert offload["saved_bytes"] == none["saved_bytes"]


# ---------------------------------------------------------------- composition


def composed_layouts(rank: int) -> dict:
    from tests.helpers.layouts import run_layouts

    return run_layouts(
        rank,
        {
            "tp2 full": ("gpt4", {"tp": 2, **MODES["full"]}),
            "pp2 selective": ("gpt4", {"pp": 2, **MODES["selective"]}),
            "ddp every-2": ("gpt4", MODES["every-2"]),
        },
    )


def test_checkpointing_composes_with_tp_pp_and_ddp() -> None:
    from tests.helpers.layouts import check

    results = run_world(composed_layouts, 2, timeout=240)
    for name in ("tp2 full", "pp2 selective", "ddp every-2"):
        check(results, name, "gpt4")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_composes_with_compile(mode: str) -> None:
    torch._dynamo.reset()
    eager = run({})
    compiled = run({**MODES[mode], "compile": {"enabled": True, "backend": "aot_eager"}})
    assert_same_run(compiled, eager, tol=1e-5)


# ---------------------------------------------------------------- bad input


def test_every_zero_is_refused() -> None:
    with pytest.raises(ValidationError, match="every=0: must be >= 1"):
        RunConfig(activation_checkpointing={"mode": "full", "every": 0})


def test_selective_without_the_torch_api_names_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")
    engine = Engine(activation_checkpointing={"mode": "selective"})
    with engine, pytest.raises(MeshkitError, match=r"needs torch >= 2\.4.*use mode=full"):
        engine.prepare(tiny_gpt())


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_a_model_without_repeated_blocks_says_how_to_name_them() -> None:
    engine = Engine(activation_checkpointing={"mode": "full"})
    with (
        engine,
        pytest.raises(MeshkitError, match=r"no nn.ModuleList or nn.Sequential of repeated blocks.*config key `blocks`"),
    ):
        engine.prepare(NoBlocks())


def test_a_block_path_that_is_not_a_module_list_is_refused() -> None:
    engine = Engine(activation_checkpointing={"mode": "full"}, blocks="norm")
    with engine, pytest.raises(MeshkitError, match="'norm' is a RMSNorm, not an nn.ModuleList"):
        engine.prepare(tiny_gpt())


def test_prefetch_is_refused_without_fsdp() -> None:
    with pytest.raises(ValidationError, match="forward_prefetch applies to zero_stage=3"):
        RunConfig(sharding={"zero_stage": 2, "forward_prefetch": 1})


class PrefetchRecorder(nn.Module):
    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        self.forward_prefetch = modules

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        self.backward_prefetch = modules


def test_prefetch_names_the_next_blocks_in_each_direction() -> None:
    from meshkit.parallel.fsdp import set_prefetch

    blocks = [PrefetchRecorder() for _ in range(4)]
    set_prefetch(blocks, forward=2, backward=1)
    assert [len(b.forward_prefetch) for b in blocks] == [2, 2, 1, 0]
    assert blocks[0].forward_prefetch == blocks[1:3]
    assert blocks[3].backward_prefetch == [blocks[2]] and blocks[0].backward_prefetch == []
