"""torch.compile, of the whole model or of each repeated block ("regional")."""

from __future__ import annotations

from typing import Any

from torch import nn

from meshkit.config.schema import CompileConfig
from meshkit.models.blocks import BlockError, block_units, find_blocks


def compile_options(cfg: CompileConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"backend": cfg.backend, "fullgraph": cfg.fullgraph, "dynamic": cfg.dynamic}
    if cfg.mode != "default":
        options["mode"] = cfg.mode
    return options


def compiles_blocks(cfg: CompileConfig, hooked: bool) -> bool:
    """Per block where the user says so, else where sharding hooks sit in the model (`hooked`): dynamo skips
    FSDP2's and tensor parallel's hooks, so a whole-model graph breaks at each of them; a block compiled before
    the hooks wrap it is one clean graph (torchtitan's order). Elsewhere (DDP, one process) the whole model."""
    return cfg.regional if cfg.regional is not None else hooked


def apply_compile(
    model: nn.Module,
    cfg: CompileConfig,
    blocks: str | None = None,
    hooked: bool = False,
    eager_head: str | None = None,
) -> str:
    """Compile in place (`nn.Module.compile`), so parameter names and state-dict keys stay unchanged; returns how
    (`off`, `whole model`, `whole model but its head`, `per block (N blocks)`).

    Regional compilation compiles one block and reuses the code for its identical siblings: much shorter
    compile times than the whole model, at nearly the same speed. Chosen by the layout (`hooked`), a model
    without a list of repeated blocks is compiled whole. `eager_head`: the head that computes the fused loss
    (a chunk loop dynamo should not trace): a whole-model compile leaves it, and the forward that calls it, out
    of the graph by construction — every module beside the path to it is compiled whole — instead of breaking
    the graph at it on every step.
    """
    if not cfg.enabled:
        return "off"
    options = compile_options(cfg)
    if compiles_blocks(cfg, hooked):
        try:
            _, block_list = find_blocks(model, blocks)
        except BlockError:
            if cfg.regional:
                raise
        else:
            units = list(block_units(block_list))
            for _, block in units:
                block.compile(**options)
            return f"per block ({len(units)} blocks)"
    if eager_head:
        compiled = _compile_around(model, eager_head, options)
        return f"whole model but its head ({compiled} part{'s' * (compiled != 1)} compiled; the head eager)"
    model.compile(**options)
    return "whole model"


def _compile_around(model: nn.Module, path: str, options: dict[str, Any]) -> int:
    """Compile every child beside the path to `path` (e.g. `lm_head`: the decoder `model` compiled, the head and
    the wrapper's own forward eager); returns how many were compiled."""
    module, count = model, 0
    for name in path.split("."):
        for child_name, child in module.named_children():
            if child_name != name and any(True for _ in child.parameters()):
                child.compile(**options)
                count += 1
        module = module.get_submodule(name)
    return count


def dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) dynamo has counted in this process so far: the run's record reads how many
    came with its own steps."""
    from torch._dynamo.utils import counters  # (imported only where compile is on)

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))
