"""Memory where the logits or the MLP's activations dominate: one fine-tune step's peak resident memory (RSS) and
step time, with meshkit's fused loss against the loss from the logits, and with tiled MLPs against whole ones.

- head: a tiny Llama with Llama-3's vocabulary (hidden 64, vocab 131,072) on one 2,048-token row: the logits
  ([2048, 131072] fp32 = 1.07 GB, and their gradient) are nearly all of the step's memory;
- mlp: a Llama with a wide MLP (hidden 128, intermediate 2,048) on one 16,384-token row: the MLP's
  intermediate activations (gate, up and their product per layer) lead the activations.

Each mode runs in a fresh process (its peak RSS is the step's, not an earlier run's), one process, fp32, on this
CPU; the step time is the median of the steps after the first. Prints a table and writes JSON.

    python bench/loss_memory.py [--steps 4] [--out bench/results/loss-memory.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCENARIOS: dict[str, dict[str, Any]] = {
    "head": {"model": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=131072), "seq": 2048,
             "modes": {"logits": {"fused_loss": "off"}, "fused": {"fused_loss": "auto"}}},
    "mlp": {"model": dict(hidden_size=128, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1024), "seq": 16384,
            "modes": {"whole": {}, "tiled": {"tiled_mlp": True}}},
}  # fmt: skip


def child(scenario: str, mode: str, steps: int) -> dict[str, Any]:
    """One mode's steps in this (fresh) process: peak RSS, median step time, the losses."""
    import transformers

    from meshkit import Engine

    spec = SCENARIOS[scenario]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**spec["model"], max_position_embeddings=spec["seq"], tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    engine = Engine(seed=0, hang_doctor=False, **spec["modes"][mode])
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(1)
    seconds, losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (1, spec["seq"]), generator=generator)
        start = time.perf_counter()
        losses.append(float(engine.train_step({"input_ids": ids, "labels": ids})))
        seconds.append(time.perf_counter() - start)
    engine.end()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)
    return {"peak_rss_mb": peak_mb, "step_s": statistics.median(seconds[1:] or seconds), "losses": losses}


def run_mode(scenario: str, mode: str, steps: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", scenario, mode, "--steps", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{scenario}/{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench/results/loss-memory.json"))
    parser.add_argument("--child", nargs=2, metavar=("SCENARIO", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steps)))
        return 0
    results: dict[str, dict[str, Any]] = {}
    for scenario, spec in SCENARIOS.items():
        results[scenario] = {mode: run_mode(scenario, mode, args.steps) for mode in spec["modes"]}
        print(section_rows(scenario, results[scenario]), flush=True)
    data = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "steps": args.steps,
            "scenarios": {name: {"model": spec["model"], "seq": spec["seq"]} for name, spec in SCENARIOS.items()},
            "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def section_rows(scenario: str, modes: dict[str, dict[str, Any]]) -> str:
    baseline = next(iter(modes.values()))
    rows = []
    for mode, result in modes.items():
        drift = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], baseline["losses"], strict=True))
        peak, step = result["peak_rss_mb"], result["step_s"]
        rows.append(
            f"| {scenario} | {mode} | {peak:.0f} MB | {peak / baseline['peak_rss_mb']:.2f} "
            f"| {step * 1e3:.0f} ms | {step / baseline['step_s']:.2f} | {drift:.1e} |"
        )
    return "\n".join(rows)


def section(data: dict[str, Any]) -> str:
    """The BENCHMARKS.md table (`bench/report.py`)."""
    head = (
        f"One process, fp32, {data['steps']} steps per mode, each mode in a fresh process; ratios against the first "
        "mode of each scenario; loss drift = largest relative difference of a step's loss from it.\n\n"
        "| scenario | mode | peak RSS | vs first | median step | vs first | loss drift |\n|---|---|---|---|---|---|---|"
    )
    return "\n".join([head, *(section_rows(name, modes) for name, modes in data["results"].items())])


if __name__ == "__main__":
    raise SystemExit(main())
