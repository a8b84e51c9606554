"""How a batch becomes a loss in `engine.train_step`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from meshkit.errors import MeshkitError

LossFn = Callable[[Any, Any], torch.Tensor]


class LossError(MeshkitError):
    """A batch or model output the engine cannot turn into a loss; the message says what to pass."""


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """`loss_fn(model(inputs), targets)` for (inputs, targets) batches; otherwise the model's own loss.

    Without `loss_fn` the batch is spread into the call (`model(**batch)` for a mapping, `model(*batch)` for
    a tuple) and the output must be a scalar tensor or carry one as `.loss` / `["loss"]` (HF style).
    """
    if loss_fn is not None:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise LossError("with loss_fn, each batch must be an (inputs, targets) pair")
        inputs, targets = batch
        output = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
        return loss_fn(output, targets)
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    if isinstance(output, torch.Tensor):
        loss = output
    else:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f" (a tensor of shape {list(loss.shape)})" if isinstance(loss, torch.Tensor) else ""
        raise LossError(f"the model's output carries no scalar loss{shape}: pass loss_fn= to engine.prepare()")
    return loss
