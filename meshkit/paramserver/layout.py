"""Which server holds which parameter, and the flat buffers a worker and a server exchange."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshkit.core.errors import MeshkitError


class LayoutError(MeshkitError):
    """The model's trainable parameters cannot be served as they are."""


def place_parameters(sizes: dict[str, int], servers: int) -> dict[str, int]:
    """name -> server index: largest first onto the least-loaded server (ties: the lower index), so every
    server holds about the same number of elements; deterministic, so every rank computes the same placement."""
    load = [0] * servers
    placement: dict[str, int] = {}
    order = sorted(enumerate(sizes), key=lambda item: (-sizes[item[1]], item[0]))
    for _, name in order:
        server = min(range(servers), key=lambda s: (load[s], s))
        placement[name] = server
        load[server] += sizes[name]
    return placement


@dataclass(frozen=True)
class Shard:
    """The parameters one server holds, in model order, and how they lie in one flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)

    def flatten(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """One CPU buffer of the tensors in order (a missing gradient counts as zeros)."""
        parts = [
            torch.zeros(shape.numel(), dtype=self.dtype) if t is None else t.detach().to("cpu", self.dtype).reshape(-1)
            for t, shape in zip(tensors, self.shapes, strict=True)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The buffer cut back into tensors of the parameters' shapes (views, no copy)."""
        out, offset = [], 0
        for shape in self.shapes:
            out.append(flat[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out


def make_shards(named: list[tuple[str, torch.nn.Parameter]], servers: int) -> list[Shard]:
    """The shard of every server for these trainable parameters."""
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) > 1:
        raise LayoutError(
            f"strategy=parameter_server serves parameters of one dtype, the model's trainable ones have "
            f"{sorted(str(d) for d in dtypes)}: keep them in one dtype (mixed precision comes from precision=)"
        )
    if len(named) < servers:
        raise LayoutError(
            f"ps.servers={servers} is more than the model's {len(named)} trainable parameters: lower ps.servers"
        )
    dtype = dtypes.pop() if dtypes else torch.float32
    placement = place_parameters({name: p.numel() for name, p in named}, servers)
    return [
        Shard(
            tuple(name for name, _ in named if placement[name] == s),
            tuple(p.shape for name, p in named if placement[name] == s),
            dtype,
        )
        for s in range(servers)
    ]
