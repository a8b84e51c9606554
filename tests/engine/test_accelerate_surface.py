"""`meshkit.Accelerator` against the installed `accelerate.Accelerator`: every public member is present (or refuses
at the call in one line, and docs/migrating.md names it), and the verbs whose meaning differed act as Accelerate's
do: reduce, save / save_model / save_state (argument order, automatic naming, total_limit, hooks, overwriting),
no_sync / trigger_sync_in_backward, clip_grad_value_, split_batches, the parallel ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.distributed import leave_world, run_world

pytest.importorskip("accelerate")
REFUSED = {"lomo_backward": (None, 0.1), "deepspeed_ulysses_dl_adapter": (None, None)}
MIGRATING = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"


def members(rank: int) -> tuple[list[str], list[str], dict[str, str]]:
    import accelerate

    theirs = sorted(name for name in dir(accelerate.Accelerator(cpu=True)) if not name.startswith("_"))
    from meshkit import Accelerator

    ours = Accelerator(cpu=True)
    missing = [name for name in theirs if not hasattr(ours, name)]
    refusals = {}
    for name, arguments in REFUSED.items():
        try:
            getattr(ours, name)(*arguments)
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            refusals[name] = str(error)
    ours.end()
    return theirs, missing, refusals


def test_every_public_member_of_accelerate_is_present_or_refuses_in_one_line() -> None:
    ((theirs, missing, refusals),) = run_world(members, 1)
    assert len(theirs) >= 100 and missing == []
    page = MIGRATING.read_text()
    for name, message in refusals.items():
        assert "\n" not in message and " instead" in message, (name, message)
        assert f"`{name}" in page, f"docs/migrating.md does not list the refusal of {name}"
    assert refusals.keys() == REFUSED.keys()


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def semantics(rank: int, out_dir: str) -> dict:
    from meshkit import Accelerator, DataLoaderConfiguration, DistributedType, ProjectConfiguration

    out, got = Path(out_dir), {}
    project = ProjectConfiguration(project_dir=str(out / "project"), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(
        cpu=True, project_config=project, dataloader_config=DataLoaderConfiguration(split_batches=True)
    )
    value = torch.tensor([float(rank + 1)])
    got["reduce"] = [
        float(accelerator.reduce(value)),
        float(accelerator.reduce(value, reduction="mean")),
        float(accelerator.reduce(value, "max")),
    ]
    got["kind"] = (accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.state.num_processes)
    got["ranks"] = (
        accelerator.data_parallel_rank,
        accelerator.tensor_parallel_rank,
        accelerator.parallelism_config.dp_replicate_size,
    )
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.full((4,), float(i)) for i in range(16)]
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8))
    got["per_rank_batch"] = next(iter(loader)).shape[0]
    x = torch.full((2, 4), float(rank + 1))
    with accelerator.no_sync(model):
        accelerator.backward(model(x).sum())
    got["unsynced"] = model.module.net.weight.grad.clone()
    optimizer.zero_grad()
    with accelerator.trigger_sync_in_backward(model):
        accelerator.backward(model(x).sum())
    got["synced"] = model.module.net.weight.grad.clone()
    accelerator.clip_grad_value_(model.parameters(), 0.5)
    got["clamped"] = float(model.module.net.weight.grad.abs().max())
    optimizer.zero_grad()
    calls = []
    accelerator.register_save_state_pre_hook(
        lambda models, weights, d: calls.append(("save", len(models), sorted(weights[0]), Path(d).name))
    )
    handle = accelerator.register_load_state_pre_hook(lambda models, d: calls.append(("load", Path(d).name)))
    for _ in range(3):
        accelerator.save_state()
    accelerator.load_state()
    handle.remove()
    accelerator.load_state()
    got["hooks"], got["iteration"] = calls, accelerator.save_iteration
    got["kept"] = sorted(p.name for p in (out / "project" / "checkpoints").iterdir())
    accelerator.project_configuration.automatic_checkpoint_naming = False
    for _ in range(2):  # written over, as Accelerate does
        accelerator.save_state(str(out / "again"))
    (out / "mine").mkdir(exist_ok=True)
    (out / "mine" / "notes.txt").write_text("mine")
    try:
        accelerator.save_state(str(out / "mine"))
    except Exception as error:  # noqa: BLE001
        got["refused"] = str(error)
    accelerator.save_model(model, str(out / "exported"))
    accelerator.save({"w": torch.ones(2)}, str(out / f"from-{rank}.pt"))
    accelerator.wait_for_everyone()
    got["weights"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    leave_world()
    return got


def test_verbs_act_as_accelerates(tmp_path: Path) -> None:
    zero, one = run_world(semantics, 2, str(tmp_path))
    assert zero["reduce"] == [3.0, 1.5, 2.0]  # Accelerate's default is a sum
    assert zero["kind"] == (True, 2) and zero["ranks"] == (0, 0, 2) and one["ranks"][0] == 1
    assert zero["per_rank_batch"] == 4  # split_batches: the loader's batch is the global one
    assert not torch.equal(zero["unsynced"], one["unsynced"])  # no_sync: each rank keeps its own gradient
    assert torch.equal(zero["synced"], one["synced"])
    assert zero["clamped"] == 0.5
    save = ("save", 1, ["net.bias", "net.weight"])
    names = ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert zero["hooks"] == [
        *((*save, name) for name in names),
        ("load", "checkpoint_2"),
        (*save, "again"),
        (*save, "again"),
    ]
    assert zero["kept"] == ["checkpoint_1", "checkpoint_2"] and zero["iteration"] == 3  # total_limit=2
    assert (tmp_path / "again" / "manifest.json").is_file()
    assert "holds other files" in zero["refused"] and (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert torch.equal(exported["net.weight"], zero["weights"]["net.weight"])
    assert (tmp_path / "from-0.pt").is_file() and not (tmp_path / "from-1.pt").exists()  # the main process saves
