"""`added_tokens_overrides` (Axolotl's key): reserved tokens a tokenizer ships (`<|reserved_special_token_3|>`,
`<unused12>`) renamed to the strings a fine-tune needs (`<think>`), keeping their ids — so the embedding rows
they already have are the ones trained, and no row is added.

Only added tokens (the tokenizer's `added_tokens`, not its base vocabulary) can be renamed, as in Axolotl: the
tokenizer's files are written to a private folder, the tokens' contents changed there (and in the base
vocabulary, where the model lists them too), and the tokenizer read back; its later exports carry the new names.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from meshkit.core.errors import MeshkitError


class TokenOverrideError(MeshkitError):
    """A token id that cannot be renamed; the message names it and says which ids can."""


def renamed_added_tokens(tokenizer: Any, overrides: dict[int, str]) -> Any:
    """The tokenizer with each added token `id` of `overrides` renamed to its string (ids unchanged)."""
    wanted = {int(token_id): str(content) for token_id, content in overrides.items()}
    added = getattr(tokenizer, "added_tokens_decoder", {})
    unknown = sorted(token_id for token_id in wanted if token_id not in added)
    if unknown:
        reserved = sorted(added)
        shown = f"{reserved[:8]}{' ...' if len(reserved) > 8 else ''}"
        raise TokenOverrideError(
            f"added_tokens_overrides: token id(s) {unknown} are not added tokens of this tokenizer (only added "
            f"tokens can be renamed; its added token ids: {shown})"
        )
    old_names = {str(added[token_id]): content for token_id, content in wanted.items()}
    with tempfile.TemporaryDirectory(prefix="meshkit-tokenizer-") as scratch:
        folder = Path(scratch)
        tokenizer.save_pretrained(folder)
        _rename_in_files(folder, wanted, old_names)
        return type(tokenizer).from_pretrained(folder, local_files_only=True)


def _renamed(value: Any, old_names: dict[str, str]) -> Any:
    """A special-token setting (a name, a list of them, or a token's dict) with the old names replaced."""
    if isinstance(value, str):
        return old_names.get(value, value)
    if isinstance(value, list):
        return [_renamed(item, old_names) for item in value]
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return {**value, "content": old_names.get(value["content"], value["content"])}
    return value


def _rename_in_files(folder: Path, wanted: dict[int, str], old_names: dict[str, str]) -> None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # (lists of special tokens name them too)
        settings_file = folder / name
        if settings_file.is_file():
            settings = json.loads(settings_file.read_text())
            for key, value in settings.items():
                if key != "added_tokens_decoder" and key.endswith(("_token", "_tokens")):
                    settings[key] = _renamed(value, old_names)
            for token_id, content in wanted.items():
                entry = settings.get("added_tokens_decoder", {}).get(str(token_id))
                if entry is not None:
                    entry["content"] = content
            settings_file.write_text(json.dumps(settings, indent=2, ensure_ascii=False))
    fast_file = folder / "tokenizer.json"
    if fast_file.is_file():
        data = json.loads(fast_file.read_text())
        for entry in data.get("added_tokens", []):
            if entry.get("id") in wanted:
                entry["content"] = wanted[entry["id"]]
        vocabulary = data.get("model", {}).get("vocab")
        if isinstance(vocabulary, dict):  # (a BPE / WordPiece model that lists the reserved tokens itself)
            by_id = {token_id: token for token, token_id in vocabulary.items() if token_id in wanted}
            for token_id, old in by_id.items():
                del vocabulary[old]
                vocabulary[wanted[token_id]] = token_id
        fast_file.write_text(json.dumps(data, ensure_ascii=False))
    slow_file = folder / "added_tokens.json"  # (a slow tokenizer's added tokens: content -> id)
    if slow_file.is_file():
        listed = json.loads(slow_file.read_text())
        renamed = {wanted.get(token_id, content): token_id for content, token_id in listed.items()}
        slow_file.write_text(json.dumps(renamed, ensure_ascii=False))
