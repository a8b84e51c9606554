"""torchao's low-bit AdamW (Axolotl's `adamw_torch_8bit`, `adamw_torch_4bit`, `ao_adamw_fp8`): built by name,
stepped on plain tensors (ZeRO-3's local shards), checkpointed as float32 values and quantized again on load to the
very codes and scales it had — so a run resumes exactly. torchao compiles its update with torch.compile; the tests
run it eagerly (the same arithmetic) to keep the suite quick."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

pytest.importorskip("torchao", reason="the hf extra (torchao) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.checkpoint.optimizer_states import from_canonical, to_canonical  # noqa: E402
from meshkit.training.optimizers import OPTIMIZERS, build_optimizer  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import run_finetune, write_config  # noqa: E402

TIMEOUT = 240


def run_finetune_eagerly(rank: int, *args: Any) -> Any:
    torch.compiler.set_stance("force_eager")  # torchao's compiled update, run as plain torch
    return run_finetune(rank, *args)


@pytest.mark.parametrize("name", ["adamw_torch_8bit", "adamw_torch_4bit", "ao_adamw_fp8"])
def test_low_bit_states_round_trip_through_their_checkpoint_form_exactly(name: str) -> None:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 256))
    small = torch.nn.Parameter(torch.randn(10))  # under 4096 values: torchao keeps float32 states
    groups = [{"params": [param, small]}]
    with torch.compiler.set_stance("force_eager"):
        optimizer, notes = build_optimizer(name, groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, extra={})
        for _ in range(3):
            param.grad, small.grad = torch.randn(64, 256), torch.randn(10)
            optimizer.step()
    assert notes == [] and type(optimizer).__name__ == OPTIMIZERS[name].bnb_class
    kind = type(optimizer.state[param]["exp_avg"])
    assert kind.__module__.startswith("torchao"), kind  # quantized, not float32
    for tensor in (param, small):
        before = optimizer.state[tensor]
        stored = to_canonical(before)
        assert set(stored) == {"step", "exp_avg", "exp_avg_sq"} and stored["exp_avg"].dtype == torch.float32
        fresh, _ = build_optimizer(name, [{"params": [param, small]}], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, extra={})
        after = from_canonical(fresh, tensor, stored)
        assert float(after["step"]) == float(before["step"]) == 3.0
        for state in ("exp_avg", "exp_avg_sq"):
            assert type(after[state]) is type(before[state])
            for part in ("codes", "scale"):  # the quantized form itself, not only its values
                if hasattr(before[state], part):
                    assert torch.equal(getattr(after[state], part), getattr(before[state], part)), (state, part)
            torch.testing.assert_close(to_canonical(after)[state], stored[state], rtol=0, atol=0)


def test_zero3_steps_4bit_adamw_on_local_shards_and_resumes_exactly(tmp_path, material) -> None:
    settings = {"optimizer": "adamw_torch_4bit", "learning_rate": 1e-3, "max_steps": 4, "save_steps": 2}

    def run(name: str, world: int, *args: str, out=None) -> dict:
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        config = write_config(folder / "c.yml", material, **settings)
        assignments = [f"output_dir={out or folder / 'out'}", *args]
        return run_world(run_finetune_eagerly, world, str(config), assignments, timeout=TIMEOUT)[0]

    one = run("one", 1, "micro_batch_size=4")
    zero3 = run("zero3", 2, "zero_stage=3")
    # each rank quantizes the states of its own shard (blocks follow the shard), so within quantization error
    torch.testing.assert_close(torch.tensor(zero3["losses"]), torch.tensor(one["losses"]), rtol=1e-3, atol=0)
    checkpoints = tmp_path / "zero3" / "out" / "checkpoints"
    shutil.rmtree(checkpoints / "step-000004")
    resumed = run("zero3", 2, "zero_stage=3", "auto_resume_from_checkpoints=true")
    assert resumed["resumed_at_step"] == 2
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(zero3["losses"]), rtol=1e-6, atol=0)


def test_zero12_chunks_of_tp_shards_are_refused_for_torchao_as_for_bitsandbytes() -> None:
    from meshkit.training.optimizers import OptimizerError, check_layout

    check_layout("adamw_torch_4bit", 3, 2)
    with pytest.raises(OptimizerError, match=r"adamw_torch_8bit \(torchao\) with zero_stage 1 and tp=2"):
        check_layout("adamw_torch_8bit", 1, 2)
