"""A transformers checkpoint whose tensors are not named (or shaped) as the model's parameters: the renaming and
merging transformers itself applies in `from_pretrained`, for meshkit's own streaming loader.

transformers 5 models mixture-of-experts banks as fused 3-D tensors (`mlp.experts.gate_up_proj`), while the
checkpoints people have (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek on the hub) hold one tensor per expert and
projection (`block_sparse_moe.experts.3.w1.weight`); transformers keeps a conversion per model type that merges
them as it loads. `CheckpointConversion` asks transformers for that conversion and runs it, one model tensor at a
time, so `sharding.init_from` reads such a checkpoint as `from_pretrained` would.

A checkpoint released in MXFP4 (gpt-oss: each expert bank stored as `<name>_blocks`, packed 4-bit values, and
`<name>_scales`, one power-of-two exponent per 32 values) is dequantized the same way, by transformers' own
`convert_moe_packed_tensors` — what `from_pretrained` does with `Mxfp4Config(dequantize=True)`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

# (file tensor name, the converter pattern it matched, or None: a plain rename)
Source = tuple[str, "str | None"]
MXFP4 = "mxfp4"  # the pattern of an MXFP4 tensor's two parts
MXFP4_PARTS = ("_blocks", "_scales")


@dataclass
class CheckpointConversion:
    model: nn.Module
    renamings: list[Any]
    converters: list[Any]
    by_pattern: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> CheckpointConversion | None:
        """transformers' conversion for `model` (its own or a submodule's; MXFP4 parts besides), or None for a model
        that is not a transformers model."""
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming
        except ImportError:
            return None
        if not any(isinstance(module, PreTrainedModel) for module in model.modules()):
            return None
        transforms = get_model_conversion_mapping(cast(PreTrainedModel, model))  # (or one holding one)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        return cls(model, renamings, converters, by_pattern)

    def sources(self, stored: Iterable[str], wanted: set[str]) -> dict[str, list[Source]]:
        """Model tensor name -> the file tensors it is made of, in the order transformers merges them (natural
        order of the names: expert 2 before expert 10), for every name in `wanted` they make."""
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        made: dict[str, list[Source]] = {}
        stored = sorted(stored, key=dot_natural_key)
        for key in stored:
            renamed, pattern = rename_source_key(key, self.renamings, self.converters)
            if renamed in wanted:
                made.setdefault(renamed, []).append((key, pattern))
        present = set(stored)
        for name in wanted - made.keys():
            parts = [name + part for part in MXFP4_PARTS]
            if all(part in present for part in parts):
                made[name] = [(part, MXFP4) for part in parts]
        return made

    def tensor(self, name: str, sources: list[Source], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The model's tensor `name`, made from its file tensors (`read` gives one by its file name)."""
        pattern = sources[0][1]
        if pattern is None:  # renamed only
            return read(sources[0][0])
        if pattern == MXFP4:
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            blocks, scales = (read(key) for key, _ in sources)
            return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        converter = copy.deepcopy(self.by_pattern[pattern])
        for key, matched in sources:
            converter.add_tensor(name, key, matched, read(key))
        value = converter.convert(name, model=self.model, config=getattr(self.model, "config", None))[name]
        return value[0] if isinstance(value, list) else value
