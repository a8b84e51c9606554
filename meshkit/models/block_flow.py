"""What flows from one block to the next besides the hidden states, learnt from one traced forward.

A pipeline stage hands the next one the hidden states only. Most models pass each block nothing else that an
earlier block computed (masks and rotary tables come from the inputs); a few carry a second stream through their
blocks — Inkling's states of earlier block groups, which each block reads and the loop extends — and a stage
without it would compute something else; Gemma-3n's blocks pass several stacked streams, which the model reduces to
one after them. The facts: some input of a block, other than its hidden states, depends (in the autograd graph)
on the hidden states an earlier block took or returned; or the blocks' hidden states are shaped otherwise than
what the modules after the blocks take.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshkit.models.blocks import block_units, find_blocks
from meshkit.models.facts import ModelStructure
from meshkit.models.forward_trace import first_tensor, walk


def carried_between_blocks(model: nn.Module, structure: ModelStructure, run: Callable[[], Any]) -> str | None:
    """Why a pipeline stage could not hand the next one all it needs, in `run()` (one forward of `model`): a block
    input besides its hidden states computed from the hidden states earlier blocks took or returned, or blocks'
    hidden states the model reshapes after them (several streams reduced to one); None when neither holds or the
    forward fails."""
    blocks_path, blocks = find_blocks(model, structure.blocks)
    stream: set[Any] = set()  # autograd nodes of the hidden states the blocks took and returned so far
    found: list[str] = []
    handles = []

    def before(index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            others = [(f"argument {i}", v) for i, v in enumerate(args[1:], 1)] + list(kwargs.items())
            for name, value in others:
                if found or not isinstance(value, torch.Tensor) or value is hidden or value.grad_fn is None:
                    continue
                if any(node in stream for node in walk(value.grad_fn, stream.__contains__)):
                    found.append(
                        f"{blocks_path}.{index} takes {name} computed from the hidden states of earlier blocks"
                    )
            if isinstance(hidden, torch.Tensor) and hidden.grad_fn is not None:
                stream.add(hidden.grad_fn)

        return hook

    shapes: dict[str, tuple[int, ...]] = {}  # the last block's output, the input of what runs after the blocks

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        tensor = first_tensor(output)
        if tensor is not None and tensor.grad_fn is not None:
            stream.add(tensor.grad_fn)
        if tensor is not None:
            shapes["blocks"] = tuple(tensor.shape)

    def closing(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and "blocks" in shapes and "after" not in shapes:
            shapes["after"] = tuple(args[0].shape)

    for index, block in block_units(blocks):
        handles.append(block.register_forward_pre_hook(before(index), with_kwargs=True))
        handles.append(block.register_forward_hook(after))
    for name in structure.last_stage:
        handles.append(model.get_submodule(name).register_forward_pre_hook(closing))
    try:
        with torch.enable_grad():
            run()
    except Exception:  # noqa: BLE001 - a forward that does not run on sample tokens: nothing learnt
        return None
    finally:
        for handle in handles:
            handle.remove()
    if found:
        return found[0]
    if "after" in shapes and shapes.get("blocks") not in (None, shapes["after"]):  # (Gemma-3n's stacked streams)
        passed, closed = list(shapes["blocks"]), list(shapes["after"])
        return f"the blocks pass hidden states {passed}, which the model makes {closed} after them"
    return None
