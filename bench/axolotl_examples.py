"""Axolotl's example configs, run as written by `meshkit finetune` — offline: each hub base model becomes a tiny
random model of the same model type (`bench/tiny_models.py`), each dataset a local JSON-lines file with the fields
its `type` and field mappings read. Everything else in the config stays as written, except where a run needs it:
`output_dir` and `dataset_prepared_path` go to a scratch directory, the run stops after `--steps` steps, and hub
uploads and trackers run offline (environment variables, not keys).

    python bench/axolotl_examples.py PATH/TO/axolotl [--only REGEX] [--limit N] [--steps 2]

Prints one row per example — ok, refused (meshkit's one line), no tiny base, or failed (the error's last line) —
and writes bench/results/axolotl_examples.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import hub_type, save_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECORDS = 48  # at least; more where packed rows must fill the batches
TURN_MARKERS = ("<start_of_turn>", "<end_of_turn>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<turn|>",
                "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|im_start|>")  # fmt: skip
WORDS = ["apple", "river", "stone", "cloud", "garden", "silver", "window", "forest", "candle", "market"]


def _messages(entry: dict[str, Any], word: str, index: int) -> list[dict[str, str]]:
    """A two-turn conversation under the entry's role/content keys and role names."""
    mapping = dict(entry.get("message_property_mappings") or {})
    role = mapping.get("role") or entry.get("message_field_role") or "role"
    content = mapping.get("content") or entry.get("message_field_content") or "content"
    roles = entry.get("roles") or {}
    user = (roles.get("user") or ["user"])[0]
    assistant = (roles.get("assistant") or ["assistant"])[0]
    turns = [{role: user, content: f"Shout {word} {index}"}, {role: assistant, content: word.upper()}]
    if entry.get("type") == "sharegpt" or role == "from":
        turns = [{"from": "human", "value": f"Shout {word}"}, {"from": "gpt", "value": word.upper()}]
    return turns


def record(entry: dict[str, Any], index: int) -> dict[str, Any]:
    """One record of the shape `entry`'s type reads (a union of fields: each type takes the ones it names)."""
    word = WORDS[index % len(WORDS)]
    kind = str(entry.get("type") or "")
    if not kind:  # (no type: the records are tokenized already; ids every tiny tokenizer has)
        ids = [1 + (index + offset) % 60 for offset in range(12)]
        return {"input_ids": ids, "labels": ids, "attention_mask": [1] * len(ids)}
    out: dict[str, Any] = {
        "instruction": f"Shout the word {word}.", "input": str(index), "output": word.upper(),
        "text": f"the {word} number {index} is here", "system": "Be brief.", "question": f"Shout {word}",
        "prompt": f"Shout {word} {index}", "completion": word.upper(), "label": index % 2 == 0,
        "chosen_response": word.upper(), "rejected_response": word, "category": "shout", "answer": word.upper(),
        "completions": [f"{word} has {len(word)} letters", f"so it is {word.upper()}"], "labels": [True, index % 3 > 0],
    }  # fmt: skip
    for name in ("field_instruction", "field_input", "field_output", "field_system", "field"):
        if entry.get(name):
            out[entry[name]] = out[name.removeprefix("field_")] if name != "field" else out["text"]
    messages = _messages(entry, word, index)
    field_messages = entry.get("field_messages") or ("conversations" if kind == "sharegpt" else "messages")
    out[field_messages] = messages
    if kind in ("chat_template.argilla", "chat_template.argilla_chat"):  # (whole conversations per reply)
        user = {"role": "user", "content": f"Shout {word}"}
        out["prompt"] = user["content"]
        out["chosen"] = [user, {"role": "assistant", "content": word.upper()}]
        out["rejected"] = [user, {"role": "assistant", "content": word}]
    elif kind.startswith("chat_template.") or kind.startswith("bradley_terry"):  # preference: replies as messages
        chosen = entry.get("field_chosen") or "chosen"
        rejected = entry.get("field_rejected") or "rejected"
        out[field_messages] = messages[:1]
        out[chosen] = dict(messages[1])
        out[rejected] = {**messages[1], next(iter(messages[1].keys() - {"role", "from"}), "content"): word}
        if kind.startswith("bradley_terry"):
            out["input"], out["chosen"], out["rejected"] = f"Shout {word}", word.upper(), word
    elif kind.endswith(".ultra"):  # (UltraFeedback's binarized form: each reply a conversation ending in it)
        user = {"role": "user", "content": f"Shout {word}"}
        out["chosen"] = [user, {"role": "assistant", "content": word.upper()}]
        out["rejected"] = [user, {"role": "assistant", "content": word}]
    else:
        out["chosen"], out["rejected"] = word.upper(), word
    return out


def record_count(config: dict[str, Any]) -> int:
    """Enough records for two steps' batches on every rank the config asks for, also when samples are packed into
    rows of sequence_len."""
    rows = 2 * int(config.get("micro_batch_size") or 1) * int(config.get("gradient_accumulation_steps") or 1)
    rows *= ranks_asked(config)
    per_row = int(config.get("sequence_len") or 512) // 12 + 1 if config.get("sample_packing") else 1
    return min(20_000, max(RECORDS, 2 * rows * per_row))


def local_datasets(entries: Any, folder: Path, name: str, count: int = RECORDS) -> list[dict[str, Any]]:
    """The entries with their data in local files (and hub-only keys dropped: name, data_files, revision)."""
    out = []
    for number, entry in enumerate(entries or []):
        entry = dict(entry) if isinstance(entry, dict) else {"path": str(entry), "type": "completion"}
        path = folder / f"{name}-{number}.jsonl"
        path.write_text("".join(json.dumps(record(entry, i)) + "\n" for i in range(count)))
        for key in ("name", "data_files", "revision", "ds_type", "trust_remote_code"):
            entry.pop(key, None)
        split = str(entry.get("split") or "train")
        if not split.startswith("train"):
            entry.pop("split")
        out.append({**entry, "path": str(path)})
    return out


class TinyBases:
    """One tiny model per (model type, head), made on first use with one tokenizer for all."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.made, self.tokenizer = folder, {}, None

    def get(self, config: dict[str, Any]) -> tuple[Path | None, str]:
        name = str(config.get("base_model") or "")
        kind = hub_type(name)
        if kind is None:
            return None, f"no tiny base: the model type of '{name}' is not in bench/tiny_models.py"
        # (a hub checkpoint is the causal LM: a reward or PRM run puts its own head on it; Mistral's own tokenizer
        # file, tekken.json, makes a base of its own)
        mistral = bool(config.get("tokenizer_use_mistral_common"))
        key = f"{kind}-tekken" if mistral else kind
        if key not in self.made:
            try:
                tokenizer = self._tekken() if mistral else self._tokenizer()
                self.made[key] = save_tiny_model(kind, tokenizer, self.folder / key)
            except Exception as err:  # a config the shrinker cannot build: said as such
                self.made[key] = f"no tiny base: {kind} does not build tiny ({type(err).__name__}: {err})"[:300]
        made = self.made[key]
        return (made, kind) if isinstance(made, Path) else (None, made)

    def _tekken(self) -> Any:
        from meshkit.recipes.mistral_tokenizer import mistral_common_tokenizer
        from meshkit.recipes.tiny_model import write_tiny_tekken

        write_tiny_tekken(self.folder / "tekken")
        return mistral_common_tokenizer(self.folder / "tekken")

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            from meshkit.recipes.tiny_model import make_tiny_base_model

            texts = [json.dumps(record({"type": "alpaca"}, i)) for i in range(RECORDS)]
            base = make_tiny_base_model(self.folder / "llama-tokenizer", texts, vocab_size=320, hidden_size=16,
                                        layers=1, heads=2, kv_heads=1)  # fmt: skip
            self.tokenizer = AutoTokenizer.from_pretrained(base)
            # the turn markers real tokenizers hold as one token each (configs' eot_tokens name them)
            self.tokenizer.add_special_tokens({"additional_special_tokens": list(TURN_MARKERS)})
        return self.tokenizer


def prepared(example: Path, bases: TinyBases, folder: Path, steps: int) -> tuple[Path | None, str]:
    """The example's config made offline, or why it cannot be."""
    config = yaml.safe_load(example.read_text()) or {}
    if not isinstance(config, dict) or not (config.get("datasets") or config.get("pretraining_dataset")):
        return None, "skipped: no datasets (not a training config)"
    if config.get("processor_type") or config.get("image_size"):
        return None, "skipped: a multimodal model"
    base, kind = bases.get(config)
    if base is None:
        return None, kind
    config["base_model"] = str(base)
    for key in ("base_model_config", "tokenizer_config", "hub_model_id", "resume_from_checkpoint"):
        config.pop(key, None)
    config["datasets"] = local_datasets(config.get("datasets"), folder, "train", record_count(config))
    if config.get("test_datasets"):
        config["test_datasets"] = local_datasets(config["test_datasets"], folder, "test")
    if config.get("pretraining_dataset"):
        config["pretraining_dataset"] = local_datasets(
            config["pretraining_dataset"], folder, "pretrain", record_count(config)
        )
    config.update(output_dir=str(folder / "out"), dataset_prepared_path=str(folder / "prepared"), max_steps=steps)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, f"base {kind}"


def ranks_asked(config: dict[str, Any]) -> int:
    """The world the config's parallel sizes need (dp_shard × dp_replicate × tp × cp; ep within it), 1 if none."""
    sizes = [int(config.get(key) or 1) for key in
             ("dp_shard_size", "dp_replicate_size", "tensor_parallel_size", "context_parallel_size")]  # fmt: skip
    world = 1
    for size in sizes:
        world *= max(size, 1)
    return max(world, int(config.get("expert_parallel_size") or 1))


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *_descendants(int(child))]
    return found


def run(example: Path, bases: TinyBases, steps: int, timeout: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="axolotl-example-") as scratch:
        folder = Path(scratch)
        config, note = prepared(example, bases, folder, steps)
        if config is None:
            status = "skipped" if note.startswith("skipped") else "no tiny base"
            return {"status": status, "detail": note}
        env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        ranks = ranks_asked(yaml.safe_load(config.read_text()))  # (the layout the config asks for, as written)
        world = [f"launch.nproc_per_node={ranks}"] if ranks > 1 else []
        note = f"{note}, {ranks} ranks" if ranks > 1 else note
        start = time.monotonic()
        # a run past the timeout ends whole: its workers and dataset processes too (killing the command alone left
        # them running, orphaned, for the rest of the sweep)
        child = subprocess.Popen(
            [sys.executable, "-m", "meshkit.cli", "finetune", str(config), *world], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, cwd=folder, start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [child.pid, *_descendants(child.pid)]:  # (a launcher's workers sit in sessions of their own)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            child.communicate()
            return {"status": "failed", "detail": f"no end within {timeout} s", "base": note}
        proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
        seconds = round(time.monotonic() - start, 1)
        if proc.returncode == 0:
            return {"status": "ok", "detail": note, "seconds": seconds}
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip())  # (a launched rank prefixes its lines)
                 for line in (proc.stderr + "\n" + proc.stdout).splitlines() if line.strip()]  # fmt: skip
        error = re.compile(r"^(meshkit: error|meshkit launch:|[A-Za-z_.]*(Error|Exception)\b)")
        last = next((line for line in reversed(lines) if error.match(line)), None)
        last = last or (lines[-1] if lines else f"exit {proc.returncode}")
        refused = proc.returncode == 2 or "not supported" in last or "refus" in last
        return {"status": "refused" if refused else "failed", "detail": last[:400], "base": note, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("axolotl", type=Path, help="a checkout of Axolotl (its examples/ folder is read)")
    parser.add_argument("--only", default=None, help="a regular expression the example's path must match")
    parser.add_argument("--limit", type=int, default=None, help="at most this many examples")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per example")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per example")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "axolotl_examples.json")
    args = parser.parse_args(argv)
    examples = sorted((args.axolotl / "examples").rglob("*.y*ml"))
    if args.only:
        examples = [path for path in examples if re.search(args.only, str(path))]
    examples = examples[: args.limit] if args.limit else examples
    results: dict[str, Any] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="axolotl-bases-") as bases_dir:
        bases = TinyBases(Path(bases_dir))
        for number, example in enumerate(examples, 1):
            name = str(example.relative_to(args.axolotl / "examples"))
            results[name] = run(example, bases, args.steps, args.timeout)
            print(f"[{number}/{len(examples)}] {results[name]['status']:<13} {name}  {results[name]['detail'][:140]}")
            _write(args.out, results, len(examples))  # (after each: an interrupted sweep keeps what it ran)
    print("  ".join(f"{status}: {count}" for status, count in sorted(_counts(results).items())))
    return 0


def _counts(results: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for result in results.values():
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    return counts


def _write(out: Path, results: dict[str, Any], total: int) -> None:
    data = {"run": len(results), "of": total, "counts": _counts(results), "examples": results}
    out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
