"""Measure the activations a training step keeps for backward, per block and in total.

    with engine.activation_report() as report:
        loss = engine.train_step(batch)
    report.as_dict()   # {"saved_bytes": ..., "peak_bytes": ..., "blocks": {"layers.0": {...}, ...}, ...}

Saved-tensor hooks see every tensor autograd saves during forward. Tensors are counted by storage, once
(views of one buffer share it), on this rank (a DTensor counts its local shard); parameters are not
activations and are skipped. Inside checkpointed blocks the checkpoint decides what is kept: its inputs
(seen by the hooks), the outputs selective checkpointing caches (counted by its policy), and, during
backward, what the recomputation of one block holds until that block's backward has used it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

from meshkit.core.errors import MeshkitError
from meshkit.models.blocks import block_name, block_units, find_blocks
from meshkit.parallel.activation import CheckpointedBlock
from meshkit.parallel.compose import unwrap

OUTSIDE = "outside_blocks"


@dataclass
class BlockActivations:
    saved_bytes: int = 0  # kept from forward to backward
    recompute_bytes: int = 0  # held by this block's recomputation during backward (checkpointed blocks)


@dataclass
class ActivationReport:
    """Bytes saved for backward during the step(s) run inside `with`; see the module docstring."""

    models: list[nn.Module]
    checkpointed: list[CheckpointedBlock]
    blocks_path: str | None = None
    blocks: dict[str, BlockActivations] = field(default_factory=dict)
    _seen: dict[int, StorageWeakRef] = field(default_factory=dict)
    _current: list[str] = field(default_factory=list)
    _handles: list[RemovableHandle] = field(default_factory=list)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    # ---------------------------------------------------------------- results
    @property
    def saved_bytes(self) -> int:
        return sum(block.saved_bytes for block in self.blocks.values())

    @property
    def recompute_peak_bytes(self) -> int:
        return max((block.recompute_bytes for block in self.blocks.values()), default=0)

    @property
    def peak_bytes(self) -> int:
        """Everything kept from forward plus the largest recomputation (all of it alive at once, at most)."""
        return self.saved_bytes + self.recompute_peak_bytes

    def as_dict(self) -> dict[str, Any]:
        inside = {name: block for name, block in self.blocks.items() if name != OUTSIDE}
        return {
            "saved_bytes": self.saved_bytes,
            "recompute_peak_bytes": self.recompute_peak_bytes,
            "peak_bytes": self.peak_bytes,
            "blocks_saved_bytes": sum(block.saved_bytes for block in inside.values()),
            "outside_blocks_bytes": self.blocks.get(OUTSIDE, BlockActivations()).saved_bytes,
            "blocks": {name: vars(block).copy() for name, block in inside.items()},
            "checkpointed_blocks": [wrapper.name for wrapper in self.checkpointed if wrapper.mode != "none"],
        }

    # ---------------------------------------------------------------- measuring
    def __enter__(self) -> ActivationReport:
        if self._handles or any(wrapper.meter is not None for wrapper in self.checkpointed):
            raise MeshkitError("an activation report is already measuring: one `with` at a time")
        self.blocks.clear()
        self._seen.clear()
        self._current.clear()  # a step that failed inside a block last time leaves its name behind
        for model in self.models:
            self._track_blocks(model)
        for wrapper in self.checkpointed:
            wrapper.meter = self
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for wrapper in self.checkpointed:
            wrapper.meter = None
        self._seen.clear()  # release the storages' bookkeeping

    def _track_blocks(self, model: nn.Module) -> None:
        """Forward hooks name the block that is running, so each saved tensor is charged to it."""
        try:
            path, blocks = find_blocks(unwrap(model), self.blocks_path)
        except MeshkitError:
            return  # no repeated blocks: everything counts as outside blocks
        for index, block in block_units(blocks):
            name = block_name(path, index)
            self.blocks[name] = BlockActivations()
            self._handles.append(block.register_forward_pre_hook(self._enter_block(name)))
            self._handles.append(block.register_forward_hook(self._leave_block))

    def _enter_block(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._current.append(name)

        return hook

    def _leave_block(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._current:
            self._current.pop()

    @torch.compiler.disable  # (a measurement: never traced into a compiled model's graph)
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.observe(tensor, self._current[-1] if self._current else OUTSIDE)
        return tensor

    @torch.compiler.disable
    def observe(self, tensor: torch.Tensor, block: str, recompute: bool = False) -> None:
        """Charge `tensor`'s storage to `block` unless it is a parameter or was counted already."""
        if _is_parameter(tensor):
            return
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if local.device.type == "meta":
            return
        storage = local.untyped_storage()
        ref = StorageWeakRef(storage)  # holding it keeps the key unique: no other storage gets this address
        if ref.cdata in self._seen:
            return
        self._seen[ref.cdata] = ref
        entry = self.blocks.setdefault(block, BlockActivations())
        if recompute:
            entry.recompute_bytes += storage.nbytes()
        else:
            entry.saved_bytes += storage.nbytes()

    def recompute_hooks(self, block: str) -> contextlib.AbstractContextManager[None]:
        """Entered by checkpointing inside its recomputation: count what it saves, then let it save."""
        return self._counting_recompute(block)

    @contextlib.contextmanager
    def _counting_recompute(self, block: str) -> Iterator[None]:
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        hooks = top(False) if top is not None else None
        if hooks is None:  # an older torch: the recomputation is not measured
            yield
            return
        inner_pack, inner_unpack = hooks

        def pack(tensor: torch.Tensor) -> Any:
            self.observe(tensor, block, recompute=True)
            return inner_pack(tensor)

        with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
            yield


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter, FSDP's gathered one included), or a view of one."""
    base = tensor._base if tensor._is_view() and tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad
