"""Whether a layout that was asked for is in effect, read back from the prepared model (never from the config):
the parameters a mesh dimension split (their placements), so that a `tp=2` that split no layer stops in one line
instead of training an unsplit model on every rank with losses equal to one process."""

from __future__ import annotations

from torch import nn

from meshkit.core.errors import MeshkitError
from meshkit.runtime.dtensors import local_tensor


class LayoutNotApplied(MeshkitError):
    """A mesh dimension that was asked for split nothing; the message names it and what to do."""


def split_over(param: nn.Parameter, dim: str) -> bool:
    """The parameter is a DTensor sharded over the mesh dimension named `dim`."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(name == dim and isinstance(p, Shard) for name, p in zip(names, param.placements, strict=False))


def held_elements(models: list[nn.Module], dim: str = "tp") -> dict[str, int]:
    """Elements of the models' parameters: whole (`whole`), this rank's (`held`), and of those split over `dim`:
    the whole tensors' (`split`) and this rank's part of them (`split_held`)."""
    whole = held = split = split_held = 0
    for model in models:
        for param in model.parameters():
            local = local_tensor(param).numel()
            whole, held = whole + param.numel(), held + local
            if split_over(param, dim):
                split, split_held = split + param.numel(), split_held + local
    return {"whole": whole, "held": held, "split": split, "split_held": split_held}


SPLIT_NOTICE_SHARE = 0.1  # tp splitting less than this share of the parameters is said in one line


def check_tensor_parallel_split(model: nn.Module, tp: int, family: str | None) -> str | None:
    """tp > 1 must split some layer: a model whose every parameter stayed whole is refused in one line; one whose
    split layers are a small share of it gets a notice line (returned), as each rank holds nearly all of it."""
    if tp == 1:
        return None
    counts = held_elements([model])
    if counts["split"] == 0:
        raise LayoutNotApplied(
            f"tp={tp} split no layer of {family or 'the model'}: every rank would hold all {counts['held']:,} "
            "parameters and compute the same thing; use tp=1 (data parallel uses those ranks), or name the "
            "layers to split in tensor_parallel.plan"
        )
    share = counts["split"] / max(1, counts["whole"])
    if share < SPLIT_NOTICE_SHARE:
        return (
            f"meshkit: tp={tp} split only {share:.1%} of {family or 'the model'}'s parameters; the other "
            f"{1 - share:.1%} stay whole on every tp rank (no split of their layers is known to tensor parallel)"
        )
    return None
