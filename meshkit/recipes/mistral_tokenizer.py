"""`tokenizer_use_mistral_common: true` (Axolotl's key): Mistral's own tokenizer — `tekken.json` (or a
`tokenizer.model.v*`) read by the `mistral-common` library through transformers' `MistralCommonBackend` — instead of
a transformers tokenizer converted from it. A conversation is then encoded by mistral-common itself (its control
tokens as ids, never as text), in its fine-tuning mode, where every conversation ends with an assistant turn
(`meshkit.data.mistral_chat`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshkit.core.errors import MeshkitError


class MistralTokenizerError(MeshkitError):
    """mistral-common missing, or a directory without Mistral's tokenizer file."""


def mistral_common_tokenizer(directory: Path, mode: str = "finetuning") -> Any:
    """Mistral's tokenizer in `directory` (`mode`: finetuning, where conversations end with the answer; test, for
    generating)."""
    try:
        from transformers.tokenization_mistral_common import MistralCommonBackend
    except ImportError:
        raise MistralTokenizerError(
            "tokenizer_use_mistral_common needs the mistral-common package: pip install 'meshkit[hf]'"
        ) from None
    try:
        return MistralCommonBackend.from_pretrained(str(directory), local_files_only=True, mode=mode)
    except (OSError, ValueError, ImportError) as err:
        raise MistralTokenizerError(
            f"tokenizer_use_mistral_common: cannot read Mistral's tokenizer in '{directory}' (tekken.json or "
            f"tokenizer.model.v*): {str(err).splitlines()[0]}"
        ) from None
