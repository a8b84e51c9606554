"""Fused layers whose output the model cuts into groups before its parts (`LayerRole.groups`, traced).

CodeGen views its q/v/k projection as [..., 4, 3 · width / 4] and cuts each of the 4 groups into q, v and k: the
group count is fixed in its code, not the head count. A rank then needs the same 4 groups, each with its share
of the heads (`FusedParts.groups` regroups the rows). Where the traced group count equals the head count it is
taken to follow the heads (one group per head: a plain column split is right), and the first call checks that the
rank's forward cuts its output into its own share of groups; otherwise it stops in one line.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshkit.models.facts import AttentionFacts
from meshkit.models.forward_trace import SPLITS, VIEWS, first_tensor, walk
from meshkit.models.layer_roles import LayerRoles
from meshkit.models.structure import ModelStructure
from meshkit.parallel.tensor.auto import TensorParallelError


def grouped_layout(name: str, roles: LayerRoles | None, structure: ModelStructure, tp: int) -> tuple[int, int]:
    """(groups, head size) for a fused layer cut into a fixed number of groups, (1, 0) for any other; refuses a
    tp that does not divide the heads of a group."""
    role = roles.layers.get(name) if roles is not None else None
    attention = _attention_of(name, structure)
    if role is None or role.groups <= 1 or attention is None or attention.heads is None or not attention.head_dim:
        return 1, 0
    if role.groups in (attention.heads, attention.kv_heads):
        return 1, 0  # (one group per head: it follows the head count)
    per_group = attention.heads // role.groups
    if per_group % tp:
        raise TensorParallelError(
            f"tensor parallel: {name} cuts its output into {role.groups} fixed groups of {per_group} head(s) each, "
            f"which tp={tp} does not divide: use a tp that divides {per_group}, or tp=1"
        )
    return role.groups, attention.head_dim


def check_local_groups(model: nn.Module, roles: LayerRoles | None, structure: ModelStructure, tp: int) -> None:
    """At the first forward with gradients of each attention whose fused layer is cut into groups: that this
    rank's forward cuts it into the groups the split assumed (its share where the groups follow the heads)."""
    for name, role in roles.layers.items() if roles is not None else ():
        attention = _attention_of(name, structure)
        if role.groups <= 1 or attention is None:
            continue
        try:
            layer, region = model.get_submodule(name), model.get_submodule(attention.path)
        except AttributeError:  # (on another pipeline stage)
            continue
        fixed = grouped_layout(name, roles, structure, tp)[0] > 1
        _GroupCheck(layer, region, name, role.groups, role.groups if fixed else role.groups // tp)


class _GroupCheck:
    def __init__(self, layer: nn.Module, region: nn.Module, name: str, traced: int, expected: int) -> None:
        self.name, self.traced, self.expected = name, traced, expected
        self.output: Any = None  # the autograd node of the layer's output at its last call
        self.handles = [layer.register_forward_hook(self.layer_done), region.register_forward_hook(self.region_done)]

    def layer_done(self, module: nn.Module, args: Any, output: Any) -> None:
        tensor = first_tensor(output)
        self.output = tensor.grad_fn if tensor is not None else None

    def region_done(self, module: nn.Module, args: Any, output: Any) -> None:
        produced, result = self.output, first_tensor(output)
        if produced is None or result is None or result.grad_fn is None:
            return  # (no graph: eval or no_grad; checked at the first training forward)
        for handle in self.handles:
            handle.remove()
        cut = {
            int(node._saved_self_sym_sizes[-2])
            for node in walk(result.grad_fn, lambda node: node is produced)
            if type(node).__name__ in SPLITS
            for child, _ in node.next_functions
            if type(child).__name__ in VIEWS and any(grand is produced for grand, _ in child.next_functions)
        }
        if cut and cut != {self.expected}:
            raise TensorParallelError(
                f"tensor parallel: {self.name} cuts its output into {sorted(cut)[0]} groups on this rank where "
                f"{self.expected} were expected ({self.traced} whole: the group count is fixed in the model's code, "
                "not one group per head), so its heads cannot be split per rank: use tp=1"
            )


def _attention_of(name: str, structure: ModelStructure) -> AttentionFacts | None:
    return next((facts for facts in structure.attention if name.startswith(f"{facts.path}.")), None)
