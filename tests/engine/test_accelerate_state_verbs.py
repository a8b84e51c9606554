"""Accelerate's state verbs of meshkit.Accelerator: register_for_checkpointing, skip_first_batches, init_trackers."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from meshkit import Accelerator
from meshkit.checkpoint.storage import CheckpointError
from meshkit.core.errors import MeshkitError
from meshkit.runtime.tracking import TrackerError
from tests.helpers.distributed import run_world


class Ema:
    """A user's object with state: a tensor, a tuple, integer keys."""

    def __init__(self) -> None:
        self.shadow = torch.zeros(3, dtype=torch.bfloat16)
        self.decay = (0.99, "per-step")
        self.seen = {0: 0}

    def state_dict(self) -> dict:
        return {"shadow": self.shadow, "decay": self.decay, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.shadow, self.decay, self.seen = state["shadow"], state["decay"], state["seen"]


def test_registered_objects_come_back_with_the_checkpoint_without_pickle(tmp_path) -> None:
    with Accelerator(hang_doctor=False, logging={"dir": str(tmp_path)}) as engine:
        model = nn.Linear(2, 1)
        model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        own = torch.optim.SGD([nn.Parameter(torch.ones(1))])  # a schedule the engine was not given
        ema, counter = Ema(), torch.optim.lr_scheduler.StepLR(own, 2)
        own.step()
        engine.register_for_checkpointing(ema, counter)
        ema.shadow += torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
        ema.seen[7] = 3
        counter.step()
        engine.save_state(tmp_path / "state")
        assert "shadow" in (tmp_path / "state" / "meta.json").read_text()  # JSON: no pickle file in the directory
        saved_shadow = ema.shadow.clone()
        ema.shadow.zero_(), ema.seen.clear()
        counter.step(), counter.step()
        engine.load_state(tmp_path / "state")
        assert torch.equal(ema.shadow, saved_shadow) and ema.shadow.dtype == torch.bfloat16
        assert ema.decay == (0.99, "per-step") and ema.seen == {0: 0, 7: 3}
        assert counter.last_epoch == 1

        with pytest.raises(CheckpointError, match=r"object\(s\) 0 \(str\) lack state_dict\(\)"):
            engine.register_for_checkpointing("not stateful")
        engine.register_for_checkpointing(Ema())
        with pytest.raises(CheckpointError, match=r"holds 2 registered object\(s\) and this run registered 3"):
            engine.load_state(tmp_path / "state")
        bad = Ema()
        bad.seen = {"handle": object()}
        engine.register_for_checkpointing(bad)
        with pytest.raises(CheckpointError, match=r"registered object 3 \(Ema\)\['seen'\]\['handle'\] is a object"):
            engine.save_state(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # nothing half-written passes for a checkpoint


def _loader() -> DataLoader:
    return DataLoader(list(range(20)), batch_size=2)


def test_skip_first_batches_starts_mid_epoch_once_and_never_skips_twice(tmp_path) -> None:
    with Accelerator(hang_doctor=False, logging={"dir": str(tmp_path)}) as engine:
        loader = engine.prepare(_loader())
        assert engine.skip_first_batches(loader, 3) is loader
        assert [batch.tolist() for batch in loader][:2] == [[6, 7], [8, 9]]
        assert len([batch for batch in loader]) == 10  # the next pass is a whole epoch again
        for index, _ in enumerate(loader):
            if index == 3:  # four batches read
                engine.save_state(tmp_path / "mid")
                break
        with pytest.raises(MeshkitError, match="takes a DataLoader returned by accelerator.prepare"):
            engine.skip_first_batches(_loader(), 1)
        with pytest.raises(MeshkitError, match="num_batches is -1"):
            engine.skip_first_batches(loader, -1)
    with Accelerator(hang_doctor=False, logging={"dir": str(tmp_path)}) as engine:
        loader = engine.prepare(_loader())
        engine.load_state(tmp_path / "mid")
        engine.skip_first_batches(loader, 4)  # an Accelerate loop does both: the batch is not skipped twice
        assert next(iter(loader)).tolist() == [8, 9]


def test_init_trackers_names_the_project_and_records_the_users_config(tmp_path) -> None:
    pytest.importorskip("tensorboard")  # part of the dev extra, so CI runs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = {"dir": str(tmp_path), "trackers": ["jsonl", "tensorboard"]}
    with Accelerator(hang_doctor=False, logging=trackers) as engine:
        engine.init_trackers("demo", config={"lr": 0.1, "note": "first"}, init_kwargs={"tensorboard": {"comment": "x"}})
        engine.log({"loss": 1.0}, step=1)
        assert engine.get_tracker("tensorboard").writer.log_dir == str(tmp_path / "tensorboard")
        with pytest.raises(TrackerError, match=r"init_trackers\(\) comes before the first engine.log"):
            engine.init_trackers("again")
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.1, "note": "first"}
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert b"first" in events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0)]


def _loop_verbs(rank: int) -> dict:
    engine = Accelerator(hang_doctor=False, grad_accum_steps=2, logging={"dir": "/tmp/meshkit-test-runs"})
    torch.manual_seed(0)
    model = engine.prepare_model(nn.Linear(2, 1))
    optimizer = engine.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ran = []
    engine.on_local_process(local_process_index=1)(lambda: ran.append("local 1"))()
    with engine.local_main_process_first():
        ran.append("first")
    padded = engine.pad_across_processes(torch.full((2 + rank, 2), rank + 1), dim=0, pad_index=-1)
    front = engine.pad_across_processes(torch.full((1, 1 + rank), 5), dim=1, pad_first=True)
    if rank == 1:
        engine.set_trigger()
    triggered = (engine.check_trigger(), engine.check_trigger())
    facts = {
        "accum": engine.gradient_accumulation_steps,
        "distributed": engine.use_distributed,
        "weights": sorted(engine.get_state_dict(model)),
        "is_optimizer": isinstance(optimizer, torch.optim.Optimizer),
    }
    engine.end()
    return {"ran": ran, "padded": padded.tolist(), "front": front.tolist(), "triggered": triggered, **facts}


def test_loop_verbs_at_world_2() -> None:
    first, second = run_world(_loop_verbs, 2)
    assert first["ran"] == ["first"] and second["ran"] == ["local 1", "first"]
    assert first["padded"] == [[1, 1], [1, 1], [-1, -1]] and second["padded"] == [[2, 2]] * 3
    assert first["front"] == [[0, 5]] and second["front"] == [[5, 5]]
    assert first["triggered"] == second["triggered"] == (True, False)
    assert first["accum"] == 2 and first["distributed"] and first["weights"] == ["bias", "weight"]
    assert first["is_optimizer"] and second["is_optimizer"]


def test_clip_grad_norm_takes_accelerates_parameters_form() -> None:
    def clipped(accelerate_form: bool) -> tuple[float, torch.Tensor]:
        with Accelerator(hang_doctor=False) as engine:
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            model, _ = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            engine.backward(model(torch.ones(2, 4)).pow(2).sum() * 10)
            norm = engine.clip_grad_norm_(model.parameters(), 0.5) if accelerate_form else engine.clip_grad_norm_(0.5)
            with pytest.raises(TypeError, match=r"takes \(max_norm"):
                engine.clip_grad_norm_(model.parameters())
            return float(norm), torch.cat([p.grad.flatten() for p in model.parameters()])

    (norm_a, grad_a), (norm_b, grad_b) = clipped(True), clipped(False)
    assert norm_a == norm_b > 0.5 and torch.equal(grad_a, grad_b)
    assert grad_a.norm() == pytest.approx(0.5, rel=1e-4)
