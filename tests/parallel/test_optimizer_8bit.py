"""bitsandbytes' 8-bit AdamW under ZeRO-2 (its states stepped on a rank's flat chunk), ZeRO-3 and tp (on the local
pieces of the DTensor shards), checkpointed dequantized (requantized exactly on load), so a run resumes exactly in
its layout and reshards to another."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes", reason="the hf extra (bitsandbytes) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.checkpoint.optimizer_states import from_canonical, to_canonical  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import run_finetune, write_config  # noqa: E402

pytestmark = pytest.mark.slow  # 8-bit optimizer states in every layout

TIMEOUT = 240
FULL_8BIT = {"optimizer": "adamw_8bit", "learning_rate": 1e-3, "max_steps": 6, "save_steps": 2}


def test_8bit_states_round_trip_through_their_checkpoint_form_exactly() -> None:
    import bitsandbytes.optim as bnb_optim

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(10_000))
    optimizer = bnb_optim.AdamW8bit([param], lr=1e-2)
    for _ in range(3):
        param.grad = torch.randn(10_000)
        optimizer.step()
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[param].items()}
    stored = to_canonical(optimizer.state[param])
    assert set(stored) == {"step", "exp_avg", "exp_avg_sq"} and stored["exp_avg"].dtype == torch.float32
    fresh = bnb_optim.AdamW8bit([param], lr=1e-2)
    after = from_canonical(fresh, param, stored)
    assert after["step"] == before["step"] == 3
    for key in ("state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(after[key], before[key]), key


def _run(tmp_path: Path, material: dict, name: str, world: int, *args: str, out: Path | None = None) -> dict:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    config = write_config(folder / "c.yml", material, **FULL_8BIT)
    assignments = [f"output_dir={out or folder / 'out'}", *args]
    return run_world(run_finetune, world, str(config), assignments, timeout=TIMEOUT)[0]


def _losses(summary: dict) -> torch.Tensor:
    return torch.tensor(summary["losses"])


def test_zero2_with_8bit_adamw_tracks_one_process_and_resumes_exactly_and_resharded(tmp_path, material) -> None:
    whole = _run(tmp_path, material, "zero2", 2, "zero_stage=2")
    one = _run(tmp_path, material, "one", 1, "micro_batch_size=4")
    # blocks of 256 follow each rank's flat chunk under ZeRO-2 and each parameter in one process
    torch.testing.assert_close(_losses(whole), _losses(one), rtol=1e-3, atol=0)
    # requantized codes and scales equal the saved ones up to float rounding at bin edges
    _resumes_in_layout_and_in_one_process(tmp_path, material, "zero2", "zero_stage=2", whole)


def _resumes_in_layout_and_in_one_process(tmp_path: Path, material: dict, name: str, layout: str, run: dict) -> None:
    """From `run`'s step-2 checkpoint: the same layout continues exactly, one process within 1e-3."""
    checkpoints = tmp_path / name / "out" / "checkpoints"
    at_step_2 = tmp_path / f"{name}-at-step-2"
    shutil.copytree(checkpoints / "step-000002", at_step_2 / "checkpoints" / "step-000002")
    for late in ("step-000004", "step-000006"):
        shutil.rmtree(checkpoints / late)
    same = _run(tmp_path, material, name, 2, layout, "auto_resume_from_checkpoints=true")
    assert same["resumed_at_step"] == 2
    torch.testing.assert_close(_losses(same), _losses(run), rtol=1e-5, atol=0)
    resharded = _run(
        tmp_path, material, f"{name}-one", 1, "micro_batch_size=4", "auto_resume_from_checkpoints=true", out=at_step_2
    )
    assert resharded["resumed_at_step"] == 2
    torch.testing.assert_close(_losses(resharded), _losses(run), rtol=1e-3, atol=0)


def test_zero3_and_tp_step_8bit_adamw_on_local_shards_and_zero3_resumes_and_reshards(tmp_path, material) -> None:
    one = _run(tmp_path, material, "one", 1, "micro_batch_size=4")
    zero3 = _run(tmp_path, material, "zero3", 2, "zero_stage=3")
    tp = _run(tmp_path, material, "tp", 2, "tp=2", "micro_batch_size=4")
    # each rank quantizes the states of its own shard (blocks of 256 follow the shard, not the whole parameter)
    torch.testing.assert_close(_losses(zero3), _losses(one), rtol=1e-3, atol=0)
    torch.testing.assert_close(_losses(tp), _losses(one), rtol=1e-3, atol=0)
    _resumes_in_layout_and_in_one_process(tmp_path, material, "zero3", "zero_stage=3", zero3)


def test_only_zero12_chunks_of_tp_shards_are_refused() -> None:
    from meshkit.training.optimizers import OptimizerError, check_layout

    for zero_stage, tp in ((0, 1), (2, 1), (3, 1), (3, 2), (0, 2)):
        check_layout("adamw_8bit", zero_stage, tp)
    with pytest.raises(OptimizerError, match="zero_stage 2 and tp=2 is not supported: use zero_stage 3 or 0"):
        check_layout("adamw_8bit", 2, 2)
