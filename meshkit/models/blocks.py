"""Find a model's repeated blocks: the unit that compile, checkpointing, sharding and pipelines act on.

The blocks live in one container, an `nn.ModuleList` or an `nn.Sequential` (the model itself may be one).
The container chosen is the one with the most parameter-bearing children of a single class (a run of
decoder layers, or the Linear layers of a `Sequential(Linear, ReLU, Linear, ...)` stack), the outermost on a
tie; an MoE block's list of experts never counts. Parameter-free children (activations, dropout) stay in place
but are not units of their own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from torch import nn

from meshkit.core.errors import MeshkitError
from meshkit.models.experts import expert_banks

CONTAINERS = (nn.ModuleList, nn.Sequential)
BlockList = nn.ModuleList | nn.Sequential  # the repeated blocks' container: sized, indexable, iterable


class BlockError(MeshkitError):
    """No repeated blocks could be found; the message says how to name them."""


def is_placeholder(module: nn.Module) -> bool:
    """A pipeline stage's stand-in for a block that lives on another stage."""
    return bool(getattr(module, "is_placeholder", False))


def _repeats(container: BlockList) -> int:
    """How many parameter-bearing children of the most common class the container holds; in a ModuleList whose
    children all bear parameters, all of them (a hybrid model's blocks of two kinds: Jamba's attention and Mamba
    layers)."""
    bearing = [
        child
        for child in container.children()
        if not is_placeholder(child) and next(child.parameters(), None) is not None
    ]
    if not bearing and any(is_placeholder(child) for child in container.children()):
        return len(container)  # a pipeline stage whose blocks all live elsewhere is still the block list
    if isinstance(container, nn.ModuleList) and len(bearing) == len(container) and len(bearing) > 1:
        return len(bearing)
    return max(Counter(type(child) for child in bearing).values(), default=0)


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, BlockList]:
    """(dotted path, container) of the repeated blocks, or the container at `path` ('' = the model itself)."""
    if path is not None:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            raise BlockError(f"model has no submodule '{path}': give the dotted path of its block list") from None
        if not isinstance(found, CONTAINERS):
            raise BlockError(f"'{path}' is a {type(found).__name__}, not an nn.ModuleList or nn.Sequential of blocks")
        return path, found
    banks = expert_banks(model)  # a list of 64 experts is not the model's blocks
    candidates = [
        (name, module, repeats)
        for name, module in model.named_modules()
        if isinstance(module, CONTAINERS) and id(module) not in banks and (repeats := _repeats(module)) > 1
    ]
    if not candidates:
        raise BlockError(
            f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of repeated blocks: put its blocks in "
            "one, or name the list with blocks='path.to.layers'"
        )
    name, module, _ = max(candidates, key=lambda item: (item[2], -item[0].count("."), -len(item[0])))
    return name, module


def block_list(model: nn.Module, path: str | None) -> BlockList:
    """The block container at `path` (as the structure layer named it; None: it found none)."""
    if path is None:
        raise BlockError(f"{type(model).__name__} has no block list: name it with blocks='path.to.layers'")
    found = model.get_submodule(path) if path else model
    if not isinstance(found, CONTAINERS):
        raise BlockError(f"'{path}' is a {type(found).__name__}, not an nn.ModuleList or nn.Sequential of blocks")
    return found


def block_name(path: str, index: int) -> str:
    """The dotted name of block `index` of the container at `path`."""
    return f"{path}.{index}" if path else str(index)


def block_units(container: BlockList) -> Iterator[tuple[int, nn.Module]]:
    """(index, block) for the blocks that hold parameters here (not placeholders, not activations)."""
    for index, child in enumerate(container):
        if not is_placeholder(child) and next(child.parameters(), None) is not None:
            yield index, child
