"""BENCHMARKS.md sections that compare: a commit with the one before, layouts' memory over a run, expert
parallel against ZeRO-3, the planner's predictions against measured steps, meshkit against DeepSpeed, ring
attention with a sliding window against full attention."""

from __future__ import annotations

from typing import Any

from bench.report_table import table as _table


def against_commit(data: dict[str, Any]) -> str:
    rows = [
        [row["loop"], f"{row['old_vs_torch']:.3f}", f"{row['new_vs_torch']:.3f}", f"{row['new_over_old']:.3f}"]
        for row in data["rows"]
    ]
    return (
        f"This tree against commit `{data['commit'][:12]}`: `bench/overhead.py` from each tree in turns, "
        f"{data['rounds']} rounds of {data['steps']} steps at world {data['nproc']}; each round's meshkit step over "
        "the plain torch loop's in the same processes, median over rounds. Target: new / old ≤ 1.02.\n\n"
        + _table(["loop", "old vs torch", "new vs torch", "new / old"], rows)
    )


def peak_memory(data: dict[str, Any]) -> str:
    rows = [
        [row["layout"], f"{row['peak_step1_mb']:.0f}", f"{row['peak_end_mb']:.0f}", f"{row['growth_mb']:.0f}",
         f"{row['growth_ratio']:.3f}", str(row["last_rise_at_step"]), f"{row['median_step_s']:.2f}",
         f"{row['step_vs_glibc']:.3f}" if row.get("step_vs_glibc") else "-"]
        for row in data["rows"]
    ]  # fmt: skip
    return (
        f"World {data['nproc']}, {data['layers']} × Linear({data['width']}, {data['width']}), SGD with momentum, "
        f"{data['steps']} steps; the largest rank's peak resident memory (ru_maxrss) after step 1 and at the end, "
        "on each allocator the launcher can give CPU workers (`host_allocator`): tcmalloc (preloaded; the default "
        "where installed), glibc-flat (a fixed mmap threshold on huge pages; the default elsewhere), and glibc "
        "(`host_memory_slack_mb: null`, malloc as glibc sets it: the baseline). Targets: growth within 2 % of "
        "step 1's peak, step time within 1.03× the baseline's.\n\n"
        + _table(
            ["layout", "peak step 1 MB", "peak end MB", "growth MB", "end / step 1", "last rise", "step s", "vs glibc"],
            rows,
        )  # fmt: skip
    )


def moe(data: dict[str, Any]) -> str:
    rows = [
        [row["layout"], f"{row['median_step_s'] * 1e3:.0f} ms", f"{row['step_ratio_vs_ddp']:.2f}",
         f"{row['weights_mb']:.1f}", f"{row['optimizer_mb']:.1f}", f"{row['peak_rss_mb']:.0f}",
         f"{row['all_to_all_mb_per_step']:.2f} / {row['formula_mb_per_step']:.2f}", f"{row['ep_rank_imbalance']:.2f}",
         f"{row['expert_imbalance']:.2f}" if row["expert_imbalance"] else "-"]
        for row in data["rows"]
    ]  # fmt: skip
    model = data["model"]
    return (
        f"World {data['nproc']}, a Mixtral-style model of {model['layers']} MoE blocks ({model['experts']} experts, "
        f"top-{model['top_k']}, hidden {model['hidden']}, expert FFN {model['expert_ffn']}), global batch "
        f"{model['global_batch']} × {model['seq']} tokens, SGD with momentum, {data['steps']} steps (median, slowest "
        "rank). Weights and optimizer = what a rank holds after the last step (the optimizer: SGD's momentum, "
        "ZeRO's chunks of it); all-to-all = what a rank's expert layers send "
        "to other ranks per step, against the uniform-routing formula; balance = the busiest ep rank's (and expert's) "
        "routed tokens over the mean.\n\n"
        + _table(
            [
                "layout",
                "step",
                "vs DDP",
                "weights MB",
                "optimizer MB",
                "peak MB",
                "all-to-all MB / formula",
                "ep rank max/mean",
                "expert max/mean",
            ],
            rows,
        )  # fmt: skip
    )


def plan_vs_measured(data: dict[str, Any]) -> str:
    rows = [
        [
            row["description"],
            f"{row['predicted_step_s'] * 1e3:.1f} ms",
            f"{row['step_s'] * 1e3:.1f} ms" if row["step_s"] else row["error"],
            f"{row['relative_error']:+.0%}" if row["relative_error"] is not None else "-",
        ]
        for row in data["rows"]
    ]
    model = data["config"]["model"]
    return (
        f"World {data['world']} CPU ranks, reference GPT dim {model['dim']}, {model['n_layers']} layers, seq "
        f"{data['config']['train']['seq_len']}; the planner's top layouts (one per parallel shape first), costed on "
        "this machine's profile measured in the same run, then run for a few steps each. Spearman's rank "
        f"correlation of predicted vs measured step time: {data['spearman']:.2f}; largest error "
        f"{data['largest_relative_error']:.0%}.\n\n" + _table(["layout", "predicted", "measured", "error"], rows)
    )


def peers_deepspeed(data: dict[str, Any]) -> str:
    rows = [
        [
            row["layout"],
            f"{row['meshkit_step_s'] * 1e3:.1f} ms",
            f"{row['deepspeed_step_s'] * 1e3:.1f} ms",
            f"{row['step_ratio']:.3f}",
            f"{row['meshkit_peak_mb']:.0f} / {row['deepspeed_peak_mb']:.0f}",
            f"{row['meshkit_held_mb']:.0f} / {row['deepspeed_held_mb']:.0f}",
            "yes" if row["losses_equal"] else "no",
        ]
        for row in data["rows"]
    ]
    model = data["model"]
    header = ["layout", "meshkit", "DeepSpeed", "step ratio", "peak rss+ MB m / DS", "held MB m / DS", "same losses"]
    return (
        f"World {data['world']}, DeepSpeed {data['deepspeed']} (CPU accelerator, gloo); {model['blocks']} pre-norm MLP "
        f"blocks of dim {model['dim']} ({model['params'] / 1e6:.1f} M parameters), fp32 AdamW, micro-batch "
        f"{data['micro_batch']}, both systems reducing in 25 MB buckets; pp2 = 2 stages × 2 data-parallel, 1F1B, "
        f"{data['pipeline_microbatches']} micro-batches. {data['rounds']} rounds of separate launches, order rotating; "
        "step = median over the run (slowest rank), ratio = median of the per-round meshkit/DeepSpeed ratios. Peak "
        "rss+ = the largest rank's peak resident memory over its start; held = live tensor bytes after the last step. "
        "Both are started by torchrun, so both run on glibc's malloc as it comes (`meshkit launch` would give "
        "meshkit's workers tcmalloc where installed: `host_allocator`)."
        "\n\n" + _table(header, rows)
    )


def ring_window(data: dict[str, Any]) -> str:
    rows = [
        ["full" if row["window"] is None else str(row["window"]), f"{row['median_s'] * 1e3:.0f} ms",
         f"{row['time_ratio_vs_full']:.2f}", f"{row['sent_mb']:.1f}", f"{row['sent_ratio_vs_full']:.2f}"]
        for row in data["rows"]
    ]  # fmt: skip
    shape = data["shape"]
    return (
        f"cp {data['nproc']}, one sequence of {shape['seq']} tokens ({shape['chunk']} per chunk, 2 chunks per rank), "
        f"{shape['heads']} heads of {shape['head_dim']}, fp32; `ring_attention` forward + backward, median of "
        f"{data['repeats']} (slowest rank). Sent = bytes a rank's sends put on the wire per call (keys and values "
        "out, their gradients back). A window no wider than a chunk needs only the neighbouring ranks' blocks.\n\n"
        + _table(["window", "fwd + bwd", "vs full", "sent MB", "vs full"], rows)
    )


def preference(data: dict[str, Any]) -> str:
    rows = [
        [name, f"{run['tokens_per_s']:,.0f}", f"{run['tokens_per_s_vs_sft']:.2f}", f"{run['peak_rss_mb']:,.0f}",
         f"{run['peak_rss_vs_sft']:.2f}"]
        for name, run in data["runs"].items()
    ]  # fmt: skip
    return (
        f"World {data['world_size']} (DDP), {data['steps']} steps each, a Llama-style model (hidden {data['hidden']}, "
        f"{data['layers']} layers), {data['micro_batch']} pairs per micro-batch (SFT: as many rows), sequences up to "
        f"{data['sequence_len']} tokens; tokens/s counts every token through the policy (both rows of a pair), peak "
        "RSS is the highest rank's. The frozen copy costs one more model's weights; the precomputed reference none; "
        "LoRA's reference is the base it already holds.\n\n"
        + _table(["run", "tokens/s", "vs SFT", "peak RSS MB", "vs SFT"], rows)
    )
