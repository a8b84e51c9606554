"""Fine-tuning throughput: a LoRA fine-tune at world 2 under meshkit against the same loop under HF Accelerate,
and meshkit with sample packing against meshkit without (tokens/s of real, non-padding tokens).

A Llama-style base model (made offline, random init, BPE tokenizer trained on the example data) gets LoRA on
every Linear layer. All three loops run in the same processes on the same base model and data,
interleaved step by step (the order rotates every step), so machine noise hits all alike; each step is timed at
its slowest rank. Prints a table and writes JSON.

    python bench/finetune.py [--nproc 2] [--steps 40] [--out bench/results/finetune-w2.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshkit import Engine
from meshkit.config import LaunchSettings
from meshkit.data.formats import TokenizedSample
from meshkit.data.packing import PackedSamples, PadCollate, PaddedSamples
from meshkit.data.tokenized import load_samples
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.recipes.tiny_model import make_tiny_base_model, texts_of_jsonl

HERE = Path(__file__).resolve().parent
DATA = [
    (HERE.parent / "examples/finetune/alpaca.jsonl", "alpaca"),
    (HERE.parent / "examples/finetune/chat.jsonl", "chat_template"),
]
MICRO_BATCH, SEQ_LEN, WARMUP, LORA_R = 4, 256, 3, 16
Batch = dict[str, torch.Tensor]
Step = Callable[[Batch], None]


def lora_model(base_dir: Path, meta: bool) -> tuple[Any, Any]:
    """(peft model, the transformers model inside it) with LoRA on every Linear layer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if meta:
        config = AutoConfig.from_pretrained(base_dir)
        config.use_cache = False
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(base_dir)
        model.config.use_cache = False
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules="all-linear"))
    return peft_model, peft_model.get_base_model()


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def meshkit_runner(base_dir: Path) -> Step:
    engine = Engine(seed=0, sharding={"init_from": str(base_dir / "model.safetensors")}, hang_doctor=False)
    _, model = lora_model(base_dir, meta=True)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-3)
    engine.prepare(model, optimizer)

    def step(batch: Batch) -> None:
        engine.train_step(batch)  # the causal-LM loss over every counted token of the step

    return step


def accelerate_runner(base_dir: Path) -> Step:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    peft_model, _ = lora_model(base_dir, meta=False)
    optimizer = torch.optim.AdamW(trainable(peft_model), lr=1e-3)
    model, optimizer = accelerator.prepare(peft_model, optimizer)

    def step(batch: Batch) -> None:
        loss = model(**batch).loss  # what an Accelerate user writes: transformers' own loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step


def rank_batches(samples: list[TokenizedSample], pad_id: int, packed: bool, steps: int) -> list[tuple[Batch, int]]:
    """(batch, real tokens) for this rank: its share of the samples, padded per batch or packed into rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = samples[rank::world]
    if packed:
        rows = PackedSamples(mine, SEQ_LEN, pad_id)
        items = [rows[i] for i in range(len(rows))]
        lengths = [row.length for row in rows.rows]
        make = lambda chunk: {k: torch.stack([item[k] for item in chunk]) for k in chunk[0]}  # noqa: E731
        per_batch = max(1, MICRO_BATCH // 2)  # rows of SEQ_LEN hold about two samples each
    else:
        padded = PaddedSamples(mine)
        items = [padded[i] for i in range(len(padded))]
        lengths = [len(s.input_ids) for s in mine]
        make = PadCollate(pad_id)
        per_batch = MICRO_BATCH
    out = []
    for index in range(steps + WARMUP):
        start = (index * per_batch) % max(1, len(items) - per_batch)
        out.append((make(items[start : start + per_batch]), sum(lengths[start : start + per_batch])))
    return out


def timed(step: Step, batch: Batch) -> float:
    dist.barrier()
    start = time.perf_counter()
    step(batch)
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return elapsed.item()


def worker(steps: int, out: Path, base_dir: str) -> None:
    from transformers import AutoTokenizer

    dist.init_process_group("gloo")
    base = Path(base_dir)
    if dist.get_rank() == 0 and not (base / "config.json").is_file():
        make_tiny_base_model(base, texts_of_jsonl(p for p, _ in DATA), vocab_size=512, hidden_size=256, layers=4)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(base)
    samples, _ = load_samples(DATA, tokenizer, sequence_len=SEQ_LEN, train_on_inputs=False)
    runners = {"meshkit": meshkit_runner(base), "meshkit packed": meshkit_runner(base)}
    try:
        runners["accelerate"] = accelerate_runner(base)
    except ImportError:
        print("accelerate is not installed (pip install 'meshkit[bench]'): that row is left out", file=sys.stderr)
    data = {name: rank_batches(samples, tokenizer.pad_token_id, name == "meshkit packed", steps) for name in runners}
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    tokens: dict[str, list[int]] = {name: [] for name in runners}
    names = list(runners)
    for index in range(steps + WARMUP):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            batch, count = data[name][index]
            elapsed = timed(runners[name], batch)
            total = torch.tensor(count)
            dist.all_reduce(total)
            if index >= WARMUP:
                seconds[name].append(elapsed)
                tokens[name].append(int(total))
    if dist.get_rank() == 0:
        report(seconds, tokens, dist.get_world_size(), out)
    dist.destroy_process_group()


def report(seconds: dict[str, list[float]], tokens: dict[str, list[int]], world: int, out: Path) -> None:
    rate = {name: sum(tokens[name]) / sum(seconds[name]) for name in seconds}
    result = {
        "benchmark": "LoRA fine-tune throughput (fp32, CPU/gloo, real tokens/s)",
        "date": datetime.date.today().isoformat(),
        "world_size": world,
        "steps": len(seconds["meshkit"]),
        "micro_batch": MICRO_BATCH,
        "sequence_len": SEQ_LEN,
        "lora_r": LORA_R,
        "median_step_s": {name: statistics.median(values) for name, values in seconds.items()},
        "mean_step_s": {name: statistics.fmean(values) for name, values in seconds.items()},
        "max_step_s": {name: max(values) for name, values in seconds.items()},
        "tokens_per_s": rate,
        "ratio_meshkit_vs_accelerate": rate["meshkit"] / rate["accelerate"] if "accelerate" in rate else None,
        "ratio_packed_vs_padded": rate["meshkit packed"] / rate["meshkit"],
        "torch": torch.__version__,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nLoRA fine-tune, world {world}, {result['steps']} interleaved steps each")
    print(f"{'loop':<16}{'median step (ms)':>18}{'mean (ms)':>11}{'max (ms)':>10}{'tokens/s':>12}")
    for name in seconds:
        times = [result[key][name] * 1e3 for key in ("median_step_s", "mean_step_s", "max_step_s")]
        print(f"{name:<16}{times[0]:>18.1f}{times[1]:>11.1f}{times[2]:>10.1f}{rate[name]:>12,.0f}")
    if result["ratio_meshkit_vs_accelerate"] is not None:
        print(f"meshkit / accelerate tokens/s: {result['ratio_meshkit_vs_accelerate']:.3f}")
    print(f"packed / padded tokens/s: {result['ratio_packed_vs_padded']:.3f}\nwritten to {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "finetune-w2.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.out, args.base)
        return 0
    with tempfile.TemporaryDirectory(prefix="meshkit-bench-base-") as base:
        target = LaunchTarget(
            str(Path(__file__).resolve()),
            ("--worker", "--steps", str(args.steps), "--out", str(args.out.absolute()), "--base", base),
        )
        return launch(target, LaunchPlan(LaunchSettings(nproc_per_node=args.nproc)))


if __name__ == "__main__":
    sys.exit(main())
