"""An attention's own per-head parameters (gpt-oss' and Flint's attention sinks, Doge's `A`), split with the heads.

Under tensor parallel each rank runs its own heads, so such a parameter keeps only their rows: it is stored as a
DTensor (Shard(0) over tp: checkpoints and exports see it whole), and the attention's forward — unchanged — reads
this rank's rows as a plain tensor (`to_local`, through which the gradient reaches the shard). The local view is
put in front of the parameter for the forward's duration only (an instance attribute shadows the module's
parameter lookup) and taken away after it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor

from meshkit.models.facts import AttentionFacts


class _LocalRows:
    """Forward hooks that show `names` to the module's forward as this rank's rows."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def before(self, module: nn.Module, args: Any) -> None:
        for name in self.names:
            param = module._parameters[name]
            assert isinstance(param, DTensor)
            module.__dict__[name] = param.to_local()

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        for name in self.names:
            module.__dict__.pop(name, None)


def split_head_parameters(model: nn.Module, attention: tuple[AttentionFacts, ...], mesh: DeviceMesh) -> list[str]:
    """Split every split attention's per-head parameters over `mesh` (the tp mesh); returns their names."""
    split = []
    ranks = mesh.size()
    for facts in attention:
        try:
            module = model.get_submodule(facts.path)
        except AttributeError:  # on another pipeline stage
            continue
        names = tuple(
            name
            for name in facts.head_parameters
            if isinstance(param := module._parameters.get(name), nn.Parameter)
            and not isinstance(param, DTensor)
            and param.shape[0] % ranks == 0
        )
        for name in names:
            param = module._parameters[name]
            assert param is not None
            rows = distribute_tensor(param.data, mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(rows, requires_grad=param.requires_grad))
        if names:
            hooks = _LocalRows(names)
            module.register_forward_pre_hook(hooks.before)
            module.register_forward_hook(hooks.after, always_call=True)
            split += [f"{facts.path}.{name}" for name in names]
    return split
