"""torch.compile, of the whole model or of each repeated block ("regional")."""

from __future__ import annotations

from typing import Any

from torch import nn

from meshkit.config.schema import CompileConfig
from meshkit.models.blocks import block_units, find_blocks


def compile_options(cfg: CompileConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"backend": cfg.backend, "fullgraph": cfg.fullgraph, "dynamic": cfg.dynamic}
    if cfg.mode != "default":
        options["mode"] = cfg.mode
    return options


def apply_compile(model: nn.Module, cfg: CompileConfig, blocks: str | None = None) -> nn.Module:
    """Compile in place (`nn.Module.compile`), so parameter names and state-dict keys stay unchanged.

    Regional compilation compiles one block and reuses the code for its identical siblings: much shorter
    compile times than the whole model, at nearly the same speed.
    """
    if not cfg.enabled:
        return model
    options = compile_options(cfg)
    if cfg.regional:
        _, block_list = find_blocks(model, blocks)
        for _, block in block_units(block_list):
            block.compile(**options)
    else:
        model.compile(**options)
    return model
