"""Published large training runs with their layouts and measured throughput, to hold the planner's step-time
model against (tests/planning/test_plan_performance.py, bench/plan_published.py, BENCHMARKS.md).

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (arXiv 2104.04473), Table 1: GPT models 1.7B-1T on A100-80GB DGX nodes (NVLink, 8×200 Gb/s InfiniBand), seq
  2048, vocab 51200, full activation recomputation, no ZeRO. The table's TFLOP/s per GPU count the recomputed
  forward (their eq. 3); the model-FLOPs MFU compared here removes it.
- Llama Team 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4: Llama 3 405B on H100-80GB, the
  BF16 MFU as published (model FLOPs).

For each run the planner costs every candidate it generates with the published parallel degrees (tp, cp, pp,
dp) and the published batch; the run's schedule details (chunks per rank, ZeRO stage, recomputation) are
the planner's own choice unless the paper fixes them (Megatron: no ZeRO, full recomputation, 1F1B).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshkit.config.layout import Layout
from meshkit.planning.estimate import ModelShape
from meshkit.planning.hardware import preset
from meshkit.planning.perf_model import flops_per_token
from meshkit.planning.plan import Cluster, PlannedLayout, plan

A100_BF16_PEAK = 312.0


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: ModelShape
    device: str
    gpus: int
    degrees: Layout  # the published tp, cp, pp and dp (as dp_replicate); other fields as `fixed` says
    seq_len: int
    global_batch: int
    published_mfu: float  # model FLOPs over peak, as published or derived from the paper's own numbers
    fixed: dict[str, object]  # layout fields the paper fixes (zero_stage, activation_checkpointing, ...)


def _megatron(
    params_b: float, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, tflops: float
) -> PublishedRun:
    model = ModelShape.transformer(layers=layers, hidden=hidden, heads=heads, vocab=51200)
    blocks, attention, head = flops_per_token(model, 2048)
    with_recompute = (blocks + attention) * 4 / 3 + head  # eq. 3's 96·B·s·l·h²(1 + s/6h + V/16lh), per token
    mfu = tflops / A100_BF16_PEAK * (blocks + attention + head) / with_recompute
    return PublishedRun(
        f"GPT {params_b:g}B", "Narayanan et al. 2021, Table 1", model, "a100", gpus,
        Layout(pp=pp, dp_replicate=gpus // (tp * pp), tp=tp), 2048, batch, mfu,
        {"zero_stage": 0, "activation_checkpointing": "full", "stages_per_rank": 1},
    )  # fmt: skip


# Activations as the published stack keeps them: fused norm, attention and SwiGLU kernels save about Korthikanti's
# count, not the one of transformers' modules that meshkit runs (`activation_estimate`): ffn=None selects it.
_LLAMA_405B = replace(
    ModelShape.transformer(layers=126, hidden=16384, heads=128, vocab=128256, ffn=53248, kv_heads=8), ffn=None
)


def _llama(gpus: int, cp: int, dp: int, seq_len: int, batch_per_dp: int, mfu: float) -> PublishedRun:
    return PublishedRun(
        f"Llama 3 405B, {gpus} GPUs, seq {seq_len}", "Llama Team 2024, Table 4", _LLAMA_405B, "h100", gpus,
        Layout(pp=16, dp_replicate=dp, cp=cp, tp=8), seq_len, dp * batch_per_dp, mfu, {},
    )  # fmt: skip


PUBLISHED: tuple[PublishedRun, ...] = (
    _megatron(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    _llama(8192, 1, 64, 8192, 32, 0.43),
    _llama(16384, 1, 128, 8192, 16, 0.41),
    _llama(16384, 16, 8, 131072, 16, 0.38),
)


@dataclass(frozen=True)
class Comparison:
    run: PublishedRun
    layout: PlannedLayout | None  # the fastest fitting candidate with the published degrees (None: none fits)
    candidates: int  # fitting layouts the planner proposed for the whole cluster

    @property
    def predicted_mfu(self) -> float:
        return self.layout.time.mfu if self.layout is not None and self.layout.time else 0.0

    @property
    def relative_error(self) -> float:
        return self.predicted_mfu / self.run.published_mfu - 1


def compare(run: PublishedRun) -> Comparison:
    device = preset(run.device)
    cluster = Cluster(8, device.memory_gb, nodes=run.gpus // 8, device=device)
    result = plan(run.model, cluster, seq_len=run.seq_len, global_batch=run.global_batch)
    same = [
        planned
        for planned in result.fitting
        if (planned.layout.tp, planned.layout.cp, planned.layout.pp, planned.layout.dp) == _degrees(run.degrees)
        and all(getattr(planned.layout, key) == value for key, value in run.fixed.items())
    ]
    best = min(same, key=lambda layout: layout.step_s) if same else None
    return Comparison(run, best, len(result.fitting))


def _degrees(layout: Layout) -> tuple[int, int, int, int]:
    return layout.tp, layout.cp, layout.pp, layout.dp
