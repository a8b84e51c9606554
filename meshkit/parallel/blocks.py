"""Find a model's repeated blocks: the unit that compile, checkpointing, sharding and pipelines act on."""

from __future__ import annotations

from torch import nn

from meshkit.errors import MeshkitError


class BlockError(MeshkitError):
    """No repeated blocks could be found; the message says how to name them."""


def _block_classes(blocks: nn.ModuleList) -> set[type]:
    return {type(child) for child in blocks if not getattr(child, "is_placeholder", False)}


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList]:
    """The ModuleList of same-class blocks (the longest one), or the one at `path` (e.g. 'model.layers').

    Placeholders (modules with `is_placeholder = True`, e.g. a pipeline stage's stand-ins for blocks that live
    on other stages) do not count as a different class.
    """
    if path is not None:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            raise BlockError(f"model has no submodule '{path}': give the dotted path of its block list") from None
        if not isinstance(found, nn.ModuleList):
            raise BlockError(f"'{path}' is a {type(found).__name__}, not an nn.ModuleList of blocks")
        return path, found
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len(_block_classes(module)) == 1
    ]
    if not candidates:
        raise BlockError(
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks: put its blocks in one, "
            "or name the list with blocks='path.to.layers'"
        )
    return max(candidates, key=lambda item: (len(item[1]), -item[0].count(".")))
