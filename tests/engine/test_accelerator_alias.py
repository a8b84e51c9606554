"""`meshkit.Accelerator`: the seed's Accelerate loop runs with only the import changed, at world 2 = one process."""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.distributed import run_world


class Regressor(nn.Module):
    """Takes `**batch` like a transformers model; no `.loss` on its output, so the loop's loss_fn applies."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x)


def _data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 5, generator=generator)
    return [{"x": x[i], "labels": x[i, :1] * 2} for i in range(64)]


def seed_loop(rank: int, per_rank_batch: int, out_dir: str) -> dict[str, torch.Tensor]:
    from meshkit import Accelerator, DistributedDataParallelKwargs, InitProcessGroupKwargs  # the changed import

    handlers = [InitProcessGroupKwargs(timeout=timedelta(minutes=60)), DistributedDataParallelKwargs()]
    accelerator = Accelerator(gradient_accumulation_steps=2, kwargs_handlers=handlers, project_dir=out_dir)
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_dl = DataLoader(_data(), batch_size=per_rank_batch)
    loss_fn = nn.functional.mse_loss
    # --- the loop of seeds/000, unchanged ---
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    for step, batch in enumerate(train_dl):
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss if hasattr(outputs, "loss") else loss_fn(outputs, batch["labels"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.is_main_process and step % 100 == 0:
            accelerator.log({"train/loss": loss.item()}, step=step)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        torch.save(unwrapped.state_dict(), f"{out_dir}/model.pt")
    # ---
    assert accelerator.config.collective_timeout_s == 3600.0
    weights = {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
    accelerator.end()
    return weights


def test_the_seed_accelerate_loop_at_world_2_equals_one_process(tmp_path) -> None:
    (one,) = run_world(seed_loop, 1, 8, str(tmp_path / "one"))
    two = run_world(seed_loop, 2, 4, str(tmp_path / "two"))
    for name, tensor in one.items():
        assert float((two[0][name] - tensor).abs().max() / tensor.abs().max()) <= 1e-6, name
    saved = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    assert torch.equal(saved["net.0.weight"], two[0]["net.0.weight"])
    assert (tmp_path / "two" / "metrics.jsonl").is_file()
