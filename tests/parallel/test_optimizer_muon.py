"""`optimizer: muon`: torch's Muon for the hidden matrices, AdamW for the embedding, the head and every
non-matrix, as one optimizer — equal to the two torch optimizers stepped side by side, resumable from its state
dict, and equal to one process under ZeRO-3 and tensor parallel (each sharded matrix is orthogonalised whole)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

if not hasattr(torch.optim, "Muon"):
    pytest.skip("torch.optim.Muon needs torch >= 2.9", allow_module_level=True)

from meshkit.training.muon import MuonWithAdamW, split_for_muon  # noqa: E402
from meshkit.training.optimizers import OptimizerError, check_layout  # noqa: E402

TIMEOUT = 240


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 10)
    )


def _muon_and_adamw(model: torch.nn.Sequential) -> MuonWithAdamW:
    outer = {id(p) for index in (0, 3) for p in model[index].parameters()}  # the embedding and the head
    groups = split_for_muon([{"params": list(model.parameters()), "weight_decay": 0.1}], outer)
    return MuonWithAdamW(groups, lr=0.02, betas=(0.9, 0.95), eps=1e-8)


def _train(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randint(0, 10, (4, 5), generator=generator)).pow(2).mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_only_hidden_matrices_take_muon_and_the_steps_equal_torchs_two_optimizers() -> None:
    model, reference = _model(), _model()
    optimizer = _muon_and_adamw(model)
    kinds = [(group["use_muon"], [tuple(p.shape) for p in group["params"]]) for group in optimizer.param_groups]
    assert kinds == [(True, [(16, 8)]), (False, [(10, 8), (16,), (16,), (16,), (10, 16), (10,)])]
    muon = torch.optim.Muon([reference[1].weight], lr=0.02, weight_decay=0.1)
    rest = [p for name, p in reference.named_parameters() if name != "1.weight"]
    adamw = torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    _train(model, [optimizer], 3)
    _train(reference, [muon, adamw], 3)
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    assert set(optimizer.state[model[1].weight]) == {"momentum_buffer"}
    assert set(optimizer.state[model[0].weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_run_resumed_from_the_state_dict_steps_as_one_that_was_not() -> None:
    straight = _model()
    _train(straight, [_muon_and_adamw(straight)], 4)
    first = _model()
    optimizer = _muon_and_adamw(first)
    _train(first, [optimizer], 2)
    saved = copy.deepcopy((first.state_dict(), optimizer.state_dict()))
    resumed = _model()
    resumed.load_state_dict(saved[0])
    fresh = _muon_and_adamw(resumed)
    fresh.load_state_dict(saved[1])
    generator_skip = torch.Generator().manual_seed(1)
    for _ in range(2):  # the batches the first two steps read
        torch.randint(0, 10, (4, 5), generator=generator_skip)
    for _ in range(2):
        resumed(torch.randint(0, 10, (4, 5), generator=generator_skip)).pow(2).mean().backward()
        fresh.step()
        fresh.zero_grad()
    for (name, mine), theirs in zip(resumed.named_parameters(), straight.parameters(), strict=True):
        assert torch.equal(mine, theirs), name


def test_flat_zero_chunks_are_refused_in_one_line() -> None:
    check_layout("muon", 3, 2)
    check_layout("muon", 0, 1)
    with pytest.raises(OptimizerError, match="optimizer: muon .* zero_stage 2 steps flat chunks"):
        check_layout("muon", 2, 1)


def test_muon_fine_tune_under_zero3_and_tp_equals_one_process(tmp_path, material) -> None:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from tests.helpers.distributed import run_world
    from tests.helpers.finetune_runs import run_finetune, write_config

    config = write_config(
        tmp_path / "c.yml", material, optimizer="muon", learning_rate=0.02, weight_decay=0.01, save_steps=2
    )

    def run(name: str, world: int, *args: str) -> dict:
        assignments = [f"output_dir={tmp_path / name}", *args]
        return run_world(run_finetune, world, str(config), assignments, timeout=TIMEOUT)[0]

    one = run("one", 1, "micro_batch_size=4")["losses"]
    assert one[-1] < one[0]
    # Newton-Schulz runs in bfloat16 (torch's definition): a last-bit difference in a gradient summed over ranks in
    # another order moves the loss by < 1e-4 relative here; orthogonalising each rank's piece alone is 7e-3 off.
    runs = {}
    for name, args in (("zero3", ("zero_stage=3",)), ("tp", ("tp=2", "micro_batch_size=4"))):
        runs[name] = run(name, 2, *args)["losses"]
        torch.testing.assert_close(torch.tensor(runs[name]), torch.tensor(one), rtol=3e-4, atol=0)
    shutil.rmtree(tmp_path / "zero3" / "checkpoints" / "step-000004")  # the momentum buffers come back from step 2
    resumed = run("zero3", 2, "zero_stage=3", "auto_resume_from_checkpoints=true")
    assert resumed["resumed_at_step"] == 2
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(runs["zero3"]), rtol=1e-6, atol=0)
