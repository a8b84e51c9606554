"""The memory estimator against peaks measured on a GPU: `torch.cuda.max_memory_allocated` of training steps
through the Engine on one NVIDIA H200 (torch 2.11 + CUDA 13, bf16 autocast, fused AdamW, SDPA, torch.compile), and
`meshkit estimate`'s total from the shape and the step's recipe alone (compiled, plain loss, fused optimizer step).

    python bench/estimate_vs_gpu.py [--out bench/results/estimate-vs-gpu.json]

Sources: the first runs on a GPU of a Llama-shaped 1.1 B model (micro-batch 8 × seq 2048 and
2 × 4096, with and without full activation checkpointing) and `make gpu-check`'s engine row (TinyLlama's shape,
bench/results/gpu-check-h200.json). tests/planning/test_gpu_memory_estimate.py holds each within ±10 %.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshkit.config.layout import Recompute  # noqa: E402
from meshkit.planning.estimate import ModelShape, estimate_memory  # noqa: E402
from meshkit.planning.step_recipe import StepRecipe  # noqa: E402

# hidden 2048, 16 layers, 32 heads / 8 kv heads, MLP 8192, vocab 32k (1.10 B parameters)
LLAMA_1B = ModelShape.transformer(layers=16, hidden=2048, heads=32, vocab=32000, ffn=8192, kv_heads=8)
# TinyLlama: 22 layers, 4 kv heads, MLP 5632 (`make gpu-check`'s model)
TINYLLAMA = ModelShape.transformer(layers=22, hidden=2048, heads=32, vocab=32000, ffn=5632, kv_heads=4)
COMPILED = StepRecipe(compiled=True, optimizer_step="fused")


@dataclass(frozen=True)
class MeasuredPeak:
    model_name: str
    model: ModelShape
    micro_batch: int
    seq_len: int
    recompute: str
    measured_gb: float
    source: str


MEASURED = (
    MeasuredPeak("Llama-shaped 1.1 B", LLAMA_1B, 8, 2048, "none", 42.53, "H200 runs, 2026-11"),
    MeasuredPeak("Llama-shaped 1.1 B", LLAMA_1B, 2, 4096, "none", 29.06, "H200 runs, 2026-11"),
    MeasuredPeak("Llama-shaped 1.1 B", LLAMA_1B, 8, 2048, "full", 22.0, "H200 runs, 2026-11"),
    MeasuredPeak("Llama-shaped 1.1 B", LLAMA_1B, 2, 4096, "full", 19.64, "H200 runs, 2026-11"),
    MeasuredPeak("TinyLlama 1.1 B", TINYLLAMA, 8, 2048, "none", 47.35, "gpu-check-h200.json, engine row"),
)


def estimate_gb(peak: MeasuredPeak, recipe: StepRecipe = COMPILED) -> float:
    recompute = cast(Recompute, peak.recompute)
    return estimate_memory(peak.model, seq_len=peak.seq_len, micro_batch=peak.micro_batch, precision="bf16",
                           activation_checkpointing=recompute, recipe=recipe).total_gb  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "estimate-vs-gpu.json")
    args = parser.parse_args()
    eager = StepRecipe(optimizer_step="fused")
    rows = [
        {
            "model": peak.model_name,
            "micro_batch": peak.micro_batch,
            "seq_len": peak.seq_len,
            "recompute": peak.recompute,
            "measured_gb": peak.measured_gb,
            "estimate_gb": estimate_gb(peak),
            "ratio": estimate_gb(peak) / peak.measured_gb,
            "eager_estimate_gb": estimate_gb(peak, eager),
            "source": peak.source,
        }
        for peak in MEASURED
    ]
    data = {"date": datetime.date.today().isoformat(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    for row in rows:
        shape = f"{row['model']:>20} {row['micro_batch']} × {row['seq_len']:<5} recompute {row['recompute']:<5}"
        print(
            f"{shape} measured {row['measured_gb']:6.2f} GB  estimate {row['estimate_gb']:6.2f} GB  {row['ratio']:.3f}"
        )
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
