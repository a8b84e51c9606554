"""Whether a causal LM returns its head's output, as it is, as its logits — learnt from how the logits are made, not
from their values, so that a model still on the meta device (every `meshkit finetune`: the weights stream in after
the layout is applied) is answered as well as one in memory.

One forward of a few tokens runs with a hook on the head and a torch-function mode that follows the head's output:
a function that keeps the values (a dtype cast, a view, `contiguous`) hands its result on as the same values; any
other (a scale, a soft-cap, a bias added after the head) does not. The logits are the head's output when the model's
returned logits are one of the followed tensors, whole (same shape). Where that is so, meshkit can compute the
next-token loss from the head's input and weight without the logits (`meshkit.training.fused_head`); where not, the
answer says why in words a user can act on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from meshkit.models.facts import ModelStructure, takes_cache_switch
from meshkit.models.hf_adapter import is_transformers_model

# functions whose result holds the values of their first argument (in another dtype, shape view or layout)
_SAME_VALUES = {
    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type, torch.Tensor.contiguous, torch.Tensor.view,
    torch.Tensor.reshape, torch.Tensor.__getitem__, torch.Tensor.clone, torch.Tensor.detach, torch.Tensor.bfloat16,
    torch.Tensor.half, torch.Tensor.double, torch.Tensor.view_as, torch.Tensor.reshape_as,
}  # fmt: skip
# scalings that keep the values where the other operand is exactly 1 (a config's `logits_scaling: 1.0`)
_SCALINGS = {torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__truediv__, torch.Tensor.mul,
             torch.Tensor.div, torch.mul, torch.div}  # fmt: skip


@dataclass(frozen=True)
class LogitsHead:
    """`name`: the head module whose output the model returns unchanged as its logits; None, with `why_not`."""

    name: str | None
    why_not: str | None = None


class _FollowHeadOutput(TorchFunctionMode):
    """Records the tensors that hold the head's output values, from the head's output through value-keeping calls."""

    def __init__(self) -> None:
        super().__init__()
        self.same: list[torch.Tensor] = []  # (kept alive: ids stay unique while the forward runs)

    def holds(self, tensor: Any) -> bool:
        return any(tensor is kept for kept in self.same)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if not (args and isinstance(result, torch.Tensor)):
            return result
        if func in _SAME_VALUES and self.holds(args[0]):
            self.same.append(result)
        elif func in _SCALINGS and len(args) == 2 and any(self.holds(a) for a in args):
            other = args[1] if self.holds(args[0]) else args[0]
            if isinstance(other, (int, float)) and other == 1:
                self.same.append(result)
        return result


def output_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of the model's output embedding (its head), where it has one."""
    getter = getattr(model, "get_output_embeddings", None)
    try:
        head = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(head, nn.Module):
        return None
    return next(((name, module) for name, module in model.named_modules() if module is head), None)


def logits_head(model: nn.Module, structure: ModelStructure) -> LogitsHead:
    """Which head's output `model` returns as its logits, unchanged (on real weights or the meta device)."""
    if not (structure.causal_lm and is_transformers_model(model)):
        return LogitsHead(None, "the model is not a transformers causal LM")
    found = output_head(model)
    if found is None:
        return LogitsHead(None, f"{type(model).__name__} names no output embedding (get_output_embeddings)")
    name, head = found
    if type(head) is not nn.Linear:  # (a quantized or adapted head computes its output its own way)
        return LogitsHead(None, f"its head {name} is a {type(head).__name__}, not a plain linear layer")
    outputs: list[torch.Tensor] = []
    follow = _FollowHeadOutput()

    def seen(module: nn.Module, args: Any, out: Any) -> None:
        outputs.append(out)
        follow.same.append(out)

    hook = head.register_forward_hook(seen)
    try:
        with torch.no_grad():
            output = _sample_forward(model, follow)
    except Exception as error:  # noqa: BLE001 - a forward that does not run on sample tokens: said, not raised
        first = str(error).splitlines()[0][:120] if str(error) else ""
        return LogitsHead(None, f"a sample forward failed ({type(error).__name__}: {first})")
    finally:
        hook.remove()
    logits = getattr(output, "logits", None)
    if len(outputs) != 1:
        return LogitsHead(None, f"its head {name} ran {len(outputs)} times in one forward")
    if not isinstance(logits, torch.Tensor) or not follow.holds(logits) or logits.shape != outputs[0].shape:
        return LogitsHead(None, "the model changes its head's output on the way to its logits (scaled or capped)")
    return LogitsHead(name)


def _sample_forward(model: nn.Module, follow: _FollowHeadOutput) -> Any:
    """The model on two rows of four tokens, in its own mode (only how the logits are made is read; a switch of
    mode may have side effects: RWKV rescales), on the meta device with a 4-D mask so that nothing is built from
    the data's values."""
    param = next(model.parameters())
    on_meta = param.device.type == "meta"
    with follow, _meta_in_bfloat16(model, on_meta):
        kwargs: dict[str, Any] = {"use_cache": False} if takes_cache_switch(model) else {}
        if on_meta:
            kwargs["attention_mask"] = torch.zeros(2, 1, 4, 4, device=param.device, dtype=param.dtype)
        ids = torch.full((2, 4), 3, dtype=torch.long, device=param.device)
        return model(input_ids=ids, **kwargs)


@contextlib.contextmanager
def _meta_in_bfloat16(model: nn.Module, on_meta: bool) -> Iterator[None]:
    """The model's meta tensors in bfloat16 while the forward runs on the meta device (the grouped matmul of
    transformers' expert banks has a meta kernel for bfloat16 only; meta tensors hold no values to lose), their
    dtypes restored after. Tensors that hold values are left as they are."""
    if not on_meta:
        yield
        return
    swapped = [(tensor, tensor.dtype) for tensor in (*model.parameters(), *model.buffers())
               if tensor.is_meta and tensor.is_floating_point() and tensor.dtype != torch.bfloat16]  # fmt: skip
    for tensor, _ in swapped:
        tensor.data = tensor.data.to(torch.bfloat16)
    try:
        yield
    finally:
        for tensor, dtype in swapped:
            tensor.data = tensor.data.to(dtype)
