"""NVMe offload (ZeRO-Infinity style): optimizer states live in memory-mapped files, paged in per block.

Between steps no optimizer state (Adam's moments, SGD's momentum) is resident: each is a file under
`offload_dir/rank<r>/`. The step walks the pages (one per block, plus one for the remaining parameters): it maps
the page's files, lets the real optimizer step just those parameters, and unmaps them again. So resident
optimizer memory is one block's states at most, instead of all of them. The maths is the user's optimizer,
unchanged. Scalar state (Adam's `step`) stays in memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit.core.errors import MeshkitError
from meshkit.models.blocks import BlockError, find_blocks
from meshkit.runtime.dtensors import local_tensor
from meshkit.training.wrapped_optimizer import WrappedOptimizer


class OffloadDirError(MeshkitError):
    """The offload directory cannot be used; the message names it and what to do."""


def check_offload_dir(path: Path) -> Path:
    """Create `path` if needed and prove it writable, before any training starts."""
    probe = path / f".meshkit-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise OffloadDirError(
            f"offload_dir '{path}' is not writable ({err.strerror or err}): choose a directory on a local disk "
            "that this user can write"
        ) from None
    return path


def block_pages(model: nn.Module, params: list[nn.Parameter], blocks: str | None = None) -> list[list[nn.Parameter]]:
    """Of `params`, those in `model`: one page per repeated block (in order), then one for the rest.

    A model without a block list gets a single page.
    """
    mine = {id(p) for p in model.parameters()}
    try:
        _, block_list = find_blocks(model, blocks)
    except BlockError:
        block_list = nn.ModuleList()
    page_of = {id(p): index for index, block in enumerate(block_list) for p in block.parameters()}
    pages: list[list[nn.Parameter]] = [[] for _ in range(len(block_list) + 1)]
    for param in params:
        if id(param) in mine:
            pages[page_of.get(id(param), len(block_list))].append(param)
    return [page for page in pages if page]


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` as a state tensor for `param` (a DTensor with the parameter's layout when it is one)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local


class NVMeOptimizer(WrappedOptimizer):
    """Wraps an optimizer so that its per-parameter states live in files between steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, directory: Path, pages: list[list[nn.Parameter]]) -> None:
        super().__init__(optimizer)  # `optimizer` keeps the hyper-parameters and scalar state
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        paged = {id(p) for page in pages for p in page}
        leftover = [p for p in params if id(p) not in paged]
        self.pages = [*pages, leftover] if leftover else list(pages)
        self.number = {id(p): index for index, p in enumerate(params)}
        self.files: dict[int, dict[str, tuple[Path, torch.dtype, torch.Size]]] = {}
        self.mapped: dict[tuple[int, str], torch.Tensor] = {}  # file mappings of the page being stepped

    @contextlib.contextmanager
    def _only(self, page: list[nn.Parameter]) -> Iterator[None]:
        """Let the optimizer see just this page's parameters for one step."""
        wanted = {id(p) for p in page}
        saved = [group["params"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in wanted]
        try:
            yield
        finally:
            for group, params in zip(self.optimizer.param_groups, saved, strict=True):
                group["params"] = params

    def _page_in(self, page: list[nn.Parameter]) -> None:
        for param in page:
            for key, (path, dtype, shape) in self.files.get(id(param), {}).items():
                mapped = torch.from_file(str(path), shared=True, size=shape.numel(), dtype=dtype).view(shape)
                self.mapped[(id(param), key)] = mapped
                device = local_tensor(param).device
                working = mapped if mapped.device == device else mapped.to(device)
                self.optimizer.state[param][key] = _like(working, param)

    def _page_out(self, page: list[nn.Parameter]) -> None:
        for param in page:
            state = self.optimizer.state.get(param, {})
            files = self.files.setdefault(id(param), {})
            for key in [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == param.shape]:
                local = local_tensor(state.pop(key))
                if key not in files:
                    files[key] = (self.directory / f"p{self.number[id(param)]:05d}-{key}.bin", local.dtype, local.shape)
                path, dtype, shape = files[key]
                mapped = self.mapped.pop((id(param), key), None)
                if mapped is None:
                    mapped = torch.from_file(str(path), shared=True, size=shape.numel(), dtype=dtype).view(shape)
                if mapped.data_ptr() != local.data_ptr():
                    mapped.copy_(local)  # a new state (first step) or a device copy: write it to the file
                # Dropping the last reference unmaps the file: its pages leave this process's memory.

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("NVMe offload steps page by page and cannot re-evaluate a closure")
        for page in self.pages:
            self._page_in(page)
            with self._only(page):
                self.optimizer.step()
            self._page_out(page)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The full state, read back from the files (the tensors stay file-backed)."""
        for page in self.pages:
            self._page_in(page)
        try:
            state = self.optimizer.state_dict()
        finally:
            for page in self.pages:
                self._page_out(page)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        for page in self.pages:
            self._page_out(page)

    @contextlib.contextmanager
    def paged_in(self) -> Iterator[None]:
        """Every state in `self.state` (file-backed) for the duration, e.g. to checkpoint or restore it."""
        for page in self.pages:
            self._page_in(page)
        try:
            yield
        finally:
            for page in self.pages:
                self._page_out(page)
