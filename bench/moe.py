"""Expert parallelism on a tiny mixture of experts (Mixtral-style, 8 experts, top-2) at world 4.

Layouts, each in a world of its own: DDP (the baseline: every rank holds every expert), ZeRO-3 (every parameter
sharded over the 4 ranks), ep 4 (each rank holds 2 experts), ep 2 × dp 2 (each rank holds 4 experts, two ranks hold
the same ones), ep 2 with ZeRO-3 on the rest, and ep 2 with ZeRO-2 (each rank's experts' optimizer chunks over the 2
ranks that hold them). Per layout: the median step time (and its ratio to DDP's), the weights and the optimizer
state (SGD momentum) a rank holds after the last step (measured), the peak resident set size, the bytes each rank's
all-to-alls sent to other ranks per step against the formula for uniform routing (4 passes × top-k × tokens × hidden
× 4 bytes × (ep − 1)/ep per MoE layer: dispatch and combine, forward and backward), and the balance: the busiest ep
rank's routed tokens over the mean (the perf model's `expert_imbalance`), and the busiest expert's over the mean.
Prints a table and writes JSON.

    python bench/moe.py [--nproc 4] [--steps 12] [--out bench/results/moe-w4.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python bench/moe.py`: the report's section sits beside it in `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_compare import moe as moe_section
from meshkit import Engine
from meshkit.config import LaunchSettings
from meshkit.launching.launch import LaunchPlan, LaunchTarget, launch
from meshkit.runtime.memory import peak_rss_bytes

EXPERTS, TOP_K, HIDDEN, EXPERT_FFN, LAYERS, VOCAB, SEQ, BATCH = 8, 2, 128, 512, 4, 512, 128, 8
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "zero3": {"zero_stage": 3, "dp_shard": -1},
    "ep4": {"ep": 4},
    "ep2 x dp2": {"ep": 2},
    "ep2 + zero3": {"ep": 2, "zero_stage": 3, "dp_shard": -1},
    "ep2 + zero2": {"ep": 2, "zero_stage": 2},
}


def tiny_moe() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class AllToAllMeter:
    """Counts what this rank's expert all-to-alls send to other ranks, and the tokens it routes to each expert."""

    def __init__(self) -> None:
        self.sent_bytes = 0
        self.routed = torch.zeros(EXPERTS, dtype=torch.int64)
        self.original = dist.all_to_all_single

    def __call__(self, output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                 group=None, async_op: bool = False):  # fmt: skip
        if input_split_sizes is not None:  # the routed hidden states (forward or backward)
            me = dist.get_rank(group)
            row = tensor[:1].numel() * tensor.element_size()
            self.sent_bytes += sum(n for j, n in enumerate(input_split_sizes) if j != me) * row
        elif tensor.dtype == torch.int64 and tensor.numel() == EXPERTS:  # a rank's tokens per expert
            self.routed += tensor
        return self.original(output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def worker(name: str, steps: int, out: Path) -> None:
    meter = AllToAllMeter()
    dist.all_to_all_single = meter  # (this bench's process only: count what the expert layers send)
    engine = Engine(seed=0, **LAYOUTS[name])
    model = tiny_moe()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, optimizer = engine.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(engine.dp_rank)
    seconds, sent = [], []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (BATCH // engine.dp_size or 1, SEQ), generator=generator)
        before = meter.sent_bytes
        start = time.perf_counter()
        engine.train_step({"input_ids": ids, "labels": ids})
        seconds.append(time.perf_counter() - start)
        sent.append(meter.sent_bytes - before)
    tokens = (BATCH // engine.dp_size or 1) * SEQ
    held = engine.memory_report()
    row = {
        "seconds": seconds,
        "sent_bytes": statistics.median(sent),
        "weights_mb": held["params"] / 2**20,
        "optimizer_mb": held["optimizer"] / 2**20,
        "peak_rss_mb": peak_rss_bytes() / 2**20,
        "routed": meter.routed.tolist(),
        "tokens": tokens,
        "ep": engine.mesh.dims.ep,
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, row)
    engine.end()
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(gathered))


def summarise(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    ep, tokens = ranks[0]["ep"], ranks[0]["tokens"]
    slowest = [max(rank["seconds"][i] for rank in ranks) for i in range(len(ranks[0]["seconds"]))]
    formula = 4 * TOP_K * tokens * HIDDEN * 4 * (ep - 1) / ep * LAYERS if ep > 1 else 0.0
    routed = torch.tensor([rank["routed"] for rank in ranks]).sum(0).double()
    per_ep_rank = routed.view(ep, -1).sum(1) if ep > 1 else routed.sum().reshape(1)
    return {
        "layout": name,
        "median_step_s": statistics.median(slowest[2:] or slowest),
        "weights_mb": max(rank["weights_mb"] for rank in ranks),
        "optimizer_mb": max(rank["optimizer_mb"] for rank in ranks),
        "peak_rss_mb": max(rank["peak_rss_mb"] for rank in ranks),
        "all_to_all_mb_per_step": max(rank["sent_bytes"] for rank in ranks) / 2**20,
        "formula_mb_per_step": formula / 2**20,
        "ep_rank_imbalance": float(per_ep_rank.max() / per_ep_rank.mean()) if ep > 1 else 1.0,
        "expert_imbalance": float(routed.max() / routed.mean()) if routed.sum() else None,
        "tokens_per_expert": routed.tolist() if routed.sum() else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layout", default=None, help="(internal) the layout a worker runs")
    parser.add_argument("--part", type=Path, default=None, help="(internal) where a world writes its figures")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.layout, args.steps, args.part)
        return 0
    out = args.out or Path(f"bench/results/moe-w{args.nproc}.json")
    rows = []
    for name in LAYOUTS:
        part = out.with_suffix(f".{name.replace(' ', '-')}.part")
        argv = ("--layout", name, "--steps", str(args.steps), "--part", str(part.resolve()))
        code = launch(
            LaunchTarget(os.path.abspath(__file__), argv), LaunchPlan(LaunchSettings(nproc_per_node=args.nproc))
        )
        if code:
            return code
        rows.append(summarise(name, json.loads(part.read_text())))
        part.unlink()
    base = rows[0]["median_step_s"]
    for row in rows:
        row["step_ratio_vs_ddp"] = row["median_step_s"] / base
    shape = {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "expert_ffn": EXPERT_FFN, "layers": LAYERS,
             "seq": SEQ, "global_batch": BATCH}  # fmt: skip
    data = {"nproc": args.nproc, "steps": args.steps, "model": shape, "rows": rows}
    print(moe_section(data))  # as BENCHMARKS.md shows it
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
