"""Preference texts -> token ids as TRL tokenizes them, and the batches a preference step reads.

Tokenizing (TRL's DPO and KTO trainers): the reply gets the tokenizer's EOS text where it does not end with it; the
prompt, prompt + chosen and prompt + rejected are tokenized whole (special tokens as the tokenizer adds them) and
the completion starts where the prompt's ids and each whole's ids first differ. Truncation (TRL's `keep_start`):
each row is cut to `sequence_len`; a record whose prompt alone fills `sequence_len` is dropped (counted).

A paired batch is [prompt + chosen rows..., prompt + rejected rows...] right-padded, labels -100 on the prompt and
the padding. A KTO batch is the prompt + completion rows, `desirable`, and the mismatched rows its KL term reads
(`kl_input_ids`, `kl_labels`): each record's prompt with the completion of the record before it within its group
of `kl_group` records (TRL rotates completions within each batch in dataset order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from meshkit.data.dataset_entry import DatasetEntry
from meshkit.data.preference_formats import PairText, PreferenceFormatter, UnpairedText
from meshkit.data.sources import load_source
from meshkit.training.loss import IGNORE_INDEX


def _common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


class PreferenceTokenizer:
    """Token ids of preference texts, as TRL's trainers make them. `bos_first`: as TRL's ORPO and CPO trainers
    (ORPO, SimPO, CPO), which tokenize without special tokens and then put the tokenizer's BOS before the prompt
    where it is not there already and its EOS after each reply — a tokenizer that defines a BOS without adding it
    (GPT-2's, many BPE tokenizers) starts those rows with BOS, where the DPO and KTO trainers' rows do not."""

    def __init__(self, tokenizer: Any, bos_first: bool = False) -> None:
        self.tokenizer = tokenizer
        self.bos_first = bos_first

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _ended(self, text: str) -> str:
        eos = self.tokenizer.eos_token
        return text if not eos or text.endswith(eos) else text + eos

    def pair(self, text: PairText) -> dict[str, list[int]]:
        if self.bos_first:
            return self._pair_bos_first(text)
        prompt = self._ids(text.prompt)
        chosen = self._ids(text.prompt + self._ended(text.chosen))
        rejected = self._ids(text.prompt + self._ended(text.rejected))
        start = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
        return {"prompt_ids": prompt[:start], "chosen_ids": chosen[start:], "rejected_ids": rejected[start:]}

    def _pair_bos_first(self, text: PairText) -> dict[str, list[int]]:
        """TRL's ORPO/CPO `tokenize_row`: each reply's ids are those of prompt + reply past the prompt's own (one
        fewer where the tokenizer merged the prompt's last token into the reply); BOS before, EOS after."""
        plain = lambda words: list(self.tokenizer(words, add_special_tokens=False)["input_ids"])  # noqa: E731
        prompt = plain(text.prompt)
        wholes = [plain(text.prompt + reply) for reply in (text.chosen, text.rejected)]
        starts = [len(prompt) - (prompt != whole[: len(prompt)]) for whole in wholes]
        start = min(starts)
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        head = wholes[0][:start]
        if bos is not None and (not head or head[0] != bos):
            head = [bos, *head]
        replies = [whole[begin:] for whole, begin in zip(wholes, starts, strict=True)]
        if eos is not None:
            replies = [reply if reply and reply[-1] == eos else [*reply, eos] for reply in replies]
        return {"prompt_ids": head, "chosen_ids": replies[0], "rejected_ids": replies[1]}

    def unpaired(self, text: UnpairedText) -> dict[str, Any]:
        prompt = self._ids(text.prompt)
        whole = self._ids(text.prompt + self._ended(text.completion))
        start = _common_prefix(prompt, whole)
        return {"prompt_ids": prompt[:start], "completion_ids": whole[start:], "label": text.desirable}


def reward_ids(tokenizer: Any, text: str, rendered: bool) -> list[int]:
    """A reward model's row as TRL tokenizes it: a rendered conversation as the chat template wrote it (no
    special tokens added); plain text with the tokenizer's special tokens and an EOS."""
    if rendered:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token
    return list(tokenizer(text if not eos or text.endswith(eos) else text + eos)["input_ids"])


@dataclass
class PreferenceReport:
    kept: int = 0
    prompt_too_long: int = 0  # dropped: the prompt alone fills sequence_len
    truncated: int = 0  # kept, some row cut to sequence_len
    repeated: int = 0  # dropped as exact repeats (dataset_exact_deduplication)
    per_file: dict[str, int] = field(default_factory=dict)


class _Tokenize:
    def __init__(
        self, formatter: PreferenceFormatter, paired: bool, source: Any, reward: bool = False, bos_first: bool = False
    ) -> None:
        self.formatter, self.paired, self.source, self.reward = formatter, paired, source, reward
        self.tokens = PreferenceTokenizer(formatter.tokenizer, bos_first)

    def __call__(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        where = self.source.where(index)
        if self.reward:
            chosen, chosen_rendered, rejected, rejected_rendered = self.formatter.reward_pair(record, where)
            tokenizer = self.formatter.tokenizer
            return {
                "chosen_ids": reward_ids(tokenizer, chosen, chosen_rendered),
                "rejected_ids": reward_ids(tokenizer, rejected, rejected_rendered),
            }
        if self.paired:
            return self.tokens.pair(self.formatter.pair(record, where))
        return self.tokens.unpaired(self.formatter.unpaired(record, where))


def load_preference_records(
    datasets: Sequence[DatasetEntry],
    tokenizer: Any,
    *,
    paired: bool,
    sequence_len: int,
    template: str | None = None,
    num_proc: int | None = None,
    keep_in_memory: bool = False,
    reward: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    bos_first: bool = False,
) -> tuple[Any, PreferenceReport]:
    """Every dataset's records tokenized (an Arrow table: prompt_ids, chosen_ids, rejected_ids — or KTO's
    prompt_ids, completion_ids, label), in dataset then record order; records whose prompt fills `sequence_len`
    dropped and counted. `bos_first`: pairs as TRL's ORPO and CPO trainers tokenize them (`PreferenceTokenizer`)."""
    from datasets import concatenate_datasets

    report, tables = PreferenceReport(), []
    for entry in datasets:
        source = load_source(entry, keep_in_memory, seed)
        formatter = PreferenceFormatter(tokenizer, entry, template, template_kwargs)
        records = source.dataset
        table = records.map(
            _Tokenize(formatter, paired, source, reward, bos_first),
            with_indices=True,
            remove_columns=records.column_names,
            num_proc=num_proc if num_proc and num_proc > 1 and len(records) >= 1024 else None,
            desc=f"meshkit: tokenizing {source.label}",
            keep_in_memory=keep_in_memory,
        )
        if reward:  # TRL's RewardTrainer drops pairs longer than max_length (cutting would move the scored token)
            fits = [
                max(len(c), len(r)) <= sequence_len
                for c, r in zip(table["chosen_ids"], table["rejected_ids"], strict=True)
            ]  # noqa: E501
            report.prompt_too_long += fits.count(False)
            report.per_file[entry.path] = fits.count(True)
            tables.append(table if all(fits) else table.select([i for i, ok in enumerate(fits) if ok]))
            continue
        prompts = [len(ids) for ids in table["prompt_ids"]]
        keep = [i for i, length in enumerate(prompts) if length < sequence_len]
        report.prompt_too_long += len(prompts) - len(keep)
        completions = table["chosen_ids" if paired else "completion_ids"]
        others = table["rejected_ids"] if paired else completions
        report.truncated += sum(1 for i in keep if prompts[i] + max(len(completions[i]), len(others[i])) > sequence_len)
        report.per_file[entry.path] = len(keep)
        tables.append(table if len(keep) == len(prompts) else table.select(keep))
    merged = concatenate_datasets(tables) if len(tables) > 1 else tables[0]
    report.kept = len(merged)
    return merged, report


def _row(prompt: Sequence[int], completion: Sequence[int], width: int) -> tuple[list[int], list[int]]:
    ids = [*prompt, *completion][:width]
    labels = ([IGNORE_INDEX] * len(prompt) + list(completion))[:width]
    return ids, labels


def padded(
    rows: list[tuple[list[int], list[int]]], pad: int, multiple_of: int = 1, width: int | None = None
) -> dict[str, torch.Tensor]:
    """(ids, labels) rows right-padded with `pad` (labels with -100) to the longest row — or to `width` (a
    pipeline's fixed shapes) — rounded up to `multiple_of` (2 × cp under context parallel); with the mask."""
    longest = width or max(len(ids) for ids, _ in rows)
    longest = -(-longest // multiple_of) * multiple_of
    input_ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for index, (ids, row_labels) in enumerate(rows):
        input_ids[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[index, : len(row_labels)] = torch.tensor(row_labels, dtype=torch.long)
        mask[index, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


@dataclass(frozen=True)
class PreferenceCollate:
    """Records (dicts of the table's columns) -> a batch; `sequence_len` cuts each row (TRL's keep_start),
    `multiple_of` pads the width (2 × cp under context parallel), `width` fixes it (pipelines)."""

    pad_token_id: int
    sequence_len: int
    paired: bool = True
    multiple_of: int = 1
    width: int | None = None

    def __call__(self, records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        cut = self.sequence_len
        if self.paired:
            rows = [_row(r["prompt_ids"], r["chosen_ids"], cut) for r in records]
            rows += [_row(r["prompt_ids"], r["rejected_ids"], cut) for r in records]
            batch = padded(rows, self.pad_token_id, self.multiple_of, self.width)
            if "reference_chosen" in records[0]:
                reference = [r["reference_chosen"] for r in records] + [r["reference_rejected"] for r in records]
                batch["reference_logps"] = torch.tensor(reference, dtype=torch.float64)
            return batch
        batch = padded(
            [_row(r["prompt_ids"], r["completion_ids"], cut) for r in records],
            self.pad_token_id,
            self.multiple_of,
            self.width,
        )
        batch["desirable"] = torch.tensor([bool(r["label"]) for r in records])
        if "kl_completion_ids" in records[0]:
            kl = padded(
                [_row(r["prompt_ids"], r["kl_completion_ids"], cut) for r in records],
                self.pad_token_id,
                self.multiple_of,
                self.width,
            )
            batch["kl_input_ids"], batch["kl_labels"] = kl["input_ids"], kl["labels"]
        for name in ("reference_logps", "reference_kl_logps"):
            if name in records[0]:
                batch[name] = torch.tensor([r[name] for r in records], dtype=torch.float64)
        return batch


def with_kl_completions(table: Any, group: int) -> Any:
    """KTO's mismatched completions: each record gets the completion of the record before it within its group of
    `group` consecutive records (the first gets the group's last)."""
    completions = list(table["completion_ids"])
    rotated: list[list[int]] = []
    for start in range(0, len(completions), group):
        chunk = completions[start : start + group]
        rotated.extend([chunk[-1], *chunk[:-1]])
    return table.add_column("kl_completion_ids", rotated)


@dataclass(frozen=True)
class RewardCollate:
    """Reward pairs -> [chosen rows..., rejected rows...] right-padded with `pad_token_id` (the head scores each
    row's last token that is not padding), with the attention mask; widths as `padded` makes them."""

    pad_token_id: int
    multiple_of: int = 1
    width: int | None = None

    def __call__(self, records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [list(r["chosen_ids"]) for r in records] + [list(r["rejected_ids"]) for r in records]
        batch = padded([(ids, []) for ids in rows], self.pad_token_id, self.multiple_of, self.width)
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
