"""Meta-device init (model init and safetensors), NVMe offload, and bad sharding input."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshkit import Engine
from meshkit.config.layout import Layout
from meshkit.config.resolve import ConfigError, resolve
from meshkit.core.io import save_safetensors
from meshkit.models.gpt import GPT, lm_loss
from meshkit.parallel.materialize import MaterializeError, materialize
from meshkit.parallel.zero.nvme import OffloadDirError
from meshkit.parallel.zero.sharding import ShardingError, UnshardedRunWarning, effective_zero_stage
from tests.helpers.distributed import leave_world, run_world
from tests.helpers.training import TINY, assert_close_relative, assert_state_close, split, tiny_gpt, token_batches


def meta_init_rank(rank: int, init_from: str | None) -> dict:
    torch.distributed.init_process_group("gloo")
    out = {}
    for stage in (3, 0):
        engine = Engine(seed=0, zero_stage=stage, sharding={"init_from": init_from})
        torch.manual_seed(7)  # the seed eager construction used
        with torch.device("meta"):
            model = GPT(TINY)
        model = engine.prepare(model)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        out[stage] = {
            "state": engine.full_state_dict(),
            "local_numel": sum(t.numel() for t in local),
            "rope": engine.unwrap_model().rope_cos.clone(),
        }
        engine.end()
    leave_world()
    return out


def test_meta_init_materialises_the_eager_weights_and_only_the_shard() -> None:
    eager = tiny_gpt(seed=7)
    for result in run_world(meta_init_rank, 2, None, timeout=180):
        for stage in (3, 0):
            assert_state_close(result[stage]["state"], eager.state_dict(), 0.0)
            torch.testing.assert_close(result[stage]["rope"], eager.rope_cos)
        total = sum(p.numel() for p in eager.parameters())
        assert result[3]["local_numel"] <= total / 2 + 64  # this rank allocated its half (plus row padding)
        assert result[0]["local_numel"] == total


def test_meta_init_streams_weights_from_safetensors(tmp_path) -> None:
    source = tiny_gpt(seed=11)
    index = save_safetensors(source.state_dict(), tmp_path, max_shard_size="30KB")
    for result in run_world(meta_init_rank, 2, str(index), timeout=180):
        for stage in (3, 0):
            assert_state_close(result[stage]["state"], source.state_dict(), 0.0)


def test_meta_init_rejects_a_checkpoint_of_another_model(tmp_path) -> None:
    save_safetensors({"layers.0.unknown": torch.zeros(2)}, tmp_path)
    with torch.device("meta"):
        model = GPT(TINY)
    with pytest.raises(MaterializeError, match=r"does not match the model: missing \['layers.0.attention"):
        materialize(model, torch.device("cpu"), tmp_path / "model.safetensors")


def nvme_rank(rank: int, directory: str) -> dict:
    torch.distributed.init_process_group("gloo")
    out = {}
    for name, overrides in {
        "zero3": {"zero_stage": 3},
        "zero3_nvme": {"zero_stage": 3, "offload": "nvme", "offload_dir": directory},
        "zero1_nvme": {"zero_stage": 1, "offload": "nvme", "offload_dir": directory + "-z1"},
    }.items():
        engine = Engine(seed=0, **overrides)
        model = tiny_gpt()
        model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=lm_loss)
        losses = []
        for batch in token_batches(5, 4):
            losses.append(engine.reduce(engine.train_step(split(batch[rank * 2 : rank * 2 + 2]))).item())
        out[name] = {"losses": losses, "state": engine.full_state_dict(), "memory": engine.memory_report()}
        engine.end()
    leave_world()
    return out


def test_nvme_offload_matches_and_keeps_no_optimizer_state_in_memory(tmp_path) -> None:
    directory = tmp_path / "nvme"
    for rank, result in enumerate(run_world(nvme_rank, 2, str(directory), timeout=240)):
        for name in ("zero3_nvme", "zero1_nvme"):
            assert_close_relative(result[name]["losses"], result["zero3"]["losses"], 1e-5)
            assert_state_close(result[name]["state"], result["zero3"]["state"], 1e-5)
        assert result["zero3"]["memory"]["optimizer"] > 0
        assert result["zero3_nvme"]["memory"]["optimizer"] < 100  # only Adam's scalar step counters
        n_params = len(list(tiny_gpt().parameters()))
        files = sorted((directory / f"rank{rank}").glob("*.bin"))
        assert len(files) == 2 * n_params  # exp_avg and exp_avg_sq per parameter
        # the files hold exactly the moments zero3 keeps in memory (all but the 4-byte step counters)
        assert sum(f.stat().st_size for f in files) == result["zero3"]["memory"]["optimizer"] - 4 * n_params
        assert len(list((tmp_path / f"nvme-z1/rank{rank}").glob("*.bin"))) == 2  # one flat chunk: two moments


def test_zero_stage_at_world_1_warns_and_trains_unsharded() -> None:
    with pytest.warns(UnshardedRunWarning, match="nothing to shard"):
        engine = Engine(zero_stage=3)
    with engine:
        assert engine.zero_stage == 0
        model = tiny_gpt()
        model, _ = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=lm_loss)
        batch = split(token_batches(1, 4)[0])
        first = engine.train_step(batch).item()
        assert engine.train_step(batch).item() < first


def test_unwritable_offload_dir_fails_before_training(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OffloadDirError, match="is not writable"):
        Engine(offload="nvme", offload_dir=str(blocker / "sub"))


def test_unsupported_combinations_name_the_nearest_supported_one() -> None:
    with pytest.raises(ConfigError, match="offload=cpu is supported with zero_stage=3"):
        resolve(code={"zero_stage": 2, "offload": "cpu"}, env={})
    with pytest.raises(ConfigError, match="offload=nvme needs offload_dir"):
        resolve(code={"offload": "nvme"}, env={})
    with pytest.raises(ConfigError, match="param_dtype applies to zero_stage=3"):
        resolve(code={"zero_stage": 1, "param_dtype": "bf16"}, env={})

    def mesh(replicate: int, shard: int) -> Layout:
        return Layout(dp_replicate=replicate, dp_shard=shard)

    with pytest.raises(ShardingError, match="use zero_stage=3 for HSDP"):
        effective_zero_stage(resolve(code={"zero_stage": 2, "dp_replicate": 2}, env={}).config.sharding, mesh(2, 2))
    with pytest.warns(UnshardedRunWarning, match="shards nothing .* the run goes on replicated, as DDP"):
        assert effective_zero_stage(resolve(code={"zero_stage": 3}, env={}).config.sharding, mesh(4, 1)) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert effective_zero_stage(resolve(code={"zero_stage": 2}, env={}).config.sharding, mesh(1, 4)) == 2


def test_zero_stage_makes_the_data_parallel_ranks_shards() -> None:
    parallel = resolve(code={"zero_stage": 3}, env={}).config.parallel
    assert (parallel.dp_replicate, parallel.dp_shard) == (1, -1)


def tied_head_rank(rank: int, zero_stage: int, checkpoint: str, meta: bool) -> list[float]:
    """A tied-head transformers model (GPT-2) trained 3 AdamW steps, built on meta (streamed) or loaded whole."""
    import transformers

    torch.distributed.init_process_group("gloo")
    init = {"sharding": {"init_from": f"{checkpoint}/model.safetensors"}} if meta else {}
    engine = Engine(seed=0, zero_stage=zero_stage, **init)
    if meta:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(checkpoint))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    model, _ = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(3, 60, (4, 16), generator=generator)[rank * 2 : rank * 2 + 2]
        losses.append(engine.train_step({"input_ids": ids, "labels": ids}).item())
    engine.end()
    leave_world()
    return losses


@pytest.mark.parametrize("zero_stage", [0, pytest.param(3, marks=pytest.mark.sweep)])
def test_a_tied_head_built_on_meta_stays_tied(tmp_path, zero_stage: int) -> None:
    """`to_empty` gives each module a parameter of its own; a head tied to the embedding must stay one tensor
    (two copies trained apart under DDP drifted from step 2)."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from tests.helpers.hf_models import causal_lm

    causal_lm("gpt2").save_pretrained(tmp_path)
    loaded, streamed = (run_world(tied_head_rank, 2, zero_stage, str(tmp_path), meta, timeout=120)[0]
                        for meta in (False, True))  # fmt: skip
    # (a model built on meta computes its loss from the logits — its head is not learnt without weights — the loaded
    # one in the head: the same up to rounding; two copies trained apart drift far beyond it from step 2)
    assert streamed == pytest.approx(loaded, rel=1e-6)
