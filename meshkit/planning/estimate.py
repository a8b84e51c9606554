"""Memory per device for a model, a layout and a workload: `meshkit estimate` and `estimate_memory()`.

Model states follow the ZeRO paper (Rajbhandari et al., 2020): with mixed precision and Adam every parameter
costs 2 bytes (16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master copy, momentum, variance) = 16Ψ,
and ZeRO stages 1, 2, 3 divide the optimizer states, then the gradients, then the weights by the number of
data-parallel ranks Nd. In fp32 the bytes are 4 + 4 + 8. Tensor and pipeline parallel divide Ψ first. That split
is `StepRecipe(weights="master")` (DeepSpeed, Megatron); meshkit's Engine keeps fp32 weights and gradients under
16-bit autocast (4 + 4 + 8, and 2 bytes of 16-bit copies kept for backward): the default. How the step runs (the
attention kernel, torch.compile, the loss, the optimizer's step) is the `StepRecipe` (`step_recipe.py`).

Activations: for a decoder whose widths are known (GQA, gated MLP, routed experts), as its modules save them
(`activation_estimate.decoder_layer_activation_bytes`, checked against measured saved tensors); otherwise
Korthikanti et al., 2022 ("Reducing Activation Recomputation in Large Transformer Models"): per layer
sbh(34 + 5as/h) bytes at 16 bits with dropout, of which 32sbh + 4as²b are 16-bit values and 2sbh + as²b are
1-byte dropout masks. The values scale with the element size (4 bytes in fp32), the masks
vanish without dropout; tensor parallel divides 24 of the 34 (all of it with sequence parallel) and the
attention scores; selective recompute drops the attention-score term; full recompute keeps only each layer's
input (2sbh). Context parallel divides the sequence. A pipeline's first stage holds `pp` micro-batches of its
L/pp layers (1F1B), i.e. L layers' worth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from meshkit.config.layout import Offload, Recompute
from meshkit.parallel.zero import BUCKETS_IN_FLIGHT
from meshkit.planning.activation_estimate import (  # noqa: F401 - layer_activation_bytes re-exported
    activation_line,
    backward_working_line,
    decoder_layer_activation_bytes,
    layer_activation_bytes,
    recomputed_layer_bytes,
)
from meshkit.planning.model_shape import (  # noqa: F401 - re-exported: the estimator's inputs
    EXPERT_COUNT_KEYS,
    EstimateError,
    ModelShape,
    moe_experts,
    moe_shape,
)
from meshkit.planning.step_recipe import StepRecipe

GB = 1e9
Precision = Literal["fp32", "bf16", "fp16"]
Optimizer = Literal["adam", "adam8bit", "adam4bit", "sgd"]


Phase = Literal["always", "backward", "step", "slack"]


# What a CPU rank's resident memory grows by on its first steps outside its tensors (torch's autograd engine and
# kernel caches, gloo's buffers, the training loop's own objects): measured as the peak RSS over the RSS at
# prepare() less the estimated tensors, `meshkit train` on examples/demo.yaml at world 1, 2 (dp, tp) and 4:
# 33-42 MB (BENCHMARKS.md, "estimate of a config").
CPU_RUNTIME_GB = 0.040


@dataclass(frozen=True)
class Line:
    name: str
    gb: float
    formula: str
    # when it is held: always; while backward runs (activations, autocast's copies); at the step's end (gradients
    # built anew each step, one recomputed layer, the optimizer's temporaries); slack: added to the larger peak
    phase: Phase = "always"


@dataclass
class Estimate:
    """The lines, and how they meet at the peak. Two moments compete: the loss's backward, with every layer's
    activations (and autocast's weight copies) alive, and the end of backward and the optimizer step, with the
    gradients (and the optimizer's temporaries) alive. Gradients that `zero_grad()` frees every step (ZeRO-2/3
    shards, a pipeline's, a single device's) belong to the second only; gradients in a buffer kept across steps
    (DDP's buckets as gradients, ZeRO-1's full buffer, allocated as backward starts) are there at both."""

    lines: list[Line] = field(default_factory=list)
    grads_meet_activations: bool = True
    host_gb: float = 0.0  # per rank, in host memory (offloaded optimizer states); not in the device total

    def gb(self, name: str) -> float:
        return sum(line.gb for line in self.lines if line.name == name)

    def _phase(self, phase: Phase) -> float:
        return sum(line.gb for line in self.lines if line.phase == phase)

    @property
    def backward_gb(self) -> float:
        kept = self.gb("grads") if self.grads_meet_activations else 0.0
        return self._phase("always") + self._phase("backward") + kept

    @property
    def step_gb(self) -> float:
        return self._phase("always") + self._phase("step")

    @property
    def total_gb(self) -> float:
        return max(self.backward_gb, self.step_gb) + self._phase("slack")

    @property
    def total_formula(self) -> str:
        backward = "backward (activations" + (", gradients kept" if self.grads_meet_activations else "") + ")"
        return f"max({backward}, step (gradients, temporaries)) + slack"

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{line.name}_gb": line.gb for line in self.lines}
        out["total_gb"] = self.total_gb
        out["backward_peak_gb"], out["step_peak_gb"] = self.backward_gb, self.step_gb
        out["formulas"] = {line.name: line.formula for line in self.lines}
        out["formulas"]["total"] = self.total_formula
        return out


Reference = Literal["none", "copy", "adapters", "precomputed"]  # preference training's reference model


def model_state_bytes(precision: Precision, optimizer: Optimizer, autocast: bool = False) -> tuple[int, int, int]:
    """Bytes per parameter for (weights, gradients, optimizer states). 16-bit training either keeps fp32 weights
    and gradients and casts in each forward (`autocast`: meshkit's Engine, FSDP2's mixed precision), or 16-bit
    weights and gradients with an fp32 master copy in the optimizer (DeepSpeed, Megatron, the ZeRO paper)."""
    # adam8bit: two 1-byte moments (bitsandbytes, torchao); adam4bit: two half-byte moments (torchao); the block
    # scales (4 bytes per 128-256 values) are left out
    moments = {"adam": 8, "adam8bit": 2, "adam4bit": 1}.get(optimizer, 4)
    if precision != "fp32" and not autocast:
        return 2, 2, 4 + moments  # fp32 master weights kept by the optimizer
    return 4, 4, moments


def estimate_memory(
    model: ModelShape,
    *,
    seq_len: int = 2048,
    micro_batch: int = 1,
    precision: Precision = "bf16",
    optimizer: Optimizer = "adam",
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    activation_checkpointing: Recompute = "none",
    offload: Offload = "none",
    sequence_parallel: bool | None = None,
    dropout: bool = False,
    gradient_as_bucket_view: bool = False,
    zero_bucket_mb: float = 25.0,
    zero3_unit_mb: float = 25.0,
    runtime_gb: float = 0.0,
    runtime_words: str = "given",
    ep: int = 1,
    reference: Reference = "none",
    recipe: StepRecipe | None = None,
    trainable_params: float | None = None,
) -> Estimate:
    """Per-device GB (10^9 bytes) for params, grads, optimizer, activations, buffers and the runtime, with
    formulas. `runtime_gb` is what the process holds outside tensors (on a CPU rank `CPU_RUNTIME_GB`; on a GPU
    the CUDA context and library workspaces), `runtime_words` where that figure came from.
    A mixture of experts keeps its routed experts whole under tp; `ep` splits them, and ZeRO-3 shards each
    rank's experts over the dp·cp/ep ranks that hold the same ones. `reference` (preference training): "copy" adds
    a frozen copy of the weights laid out like the policy's (split by tp/pp, sharded under ZeRO-3; no gradients,
    no optimizer state); "adapters" (LoRA's base with adapters off) and "precomputed" add nothing — pass the
    micro-batch in rows (a pair is two). `zero3_unit_mb`: ZeRO-3 groups small blocks into units of
    that many MB (`sharding.unit_mb`). `recipe`: how the step runs (attention kernel, compile, loss, optimizer
    step, how 16-bit weights are kept; `step_recipe.py`): by default as meshkit's Engine runs an eager step.
    `trainable_params`: the parameters that train where not all do (LoRA's adapters over a frozen base): only they
    get gradients and optimizer states."""
    _check_layout(model, zero_stage, dp, tp, pp, cp, ep)
    recipe = recipe or StepRecipe()
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    mixed = precision != "fp32"
    weight_b, grad_b, optim_b = model_state_bytes(precision, optimizer, autocast=recipe.weights == "autocast")
    dense, experts = model.local_params(tp, pp, ep)
    local = dense + experts  # parameters this device owns before ZeRO
    shards = dp * cp  # ZeRO/FSDP shards over the data-parallel (and context-parallel) ranks

    def sharded(stage: int) -> float:  # parameters left per rank when ZeRO stage `stage` shards them
        return dense / shards + experts / (shards // ep) if zero_stage >= stage else local

    trained = local if trainable_params is None else trainable_params / (tp * pp)  # (adapters: a rank's share)

    def trained_sharded(stage: int) -> float:  # trained parameters per rank under ZeRO stage `stage`
        if trainable_params is None:
            return sharded(stage)
        return trained / shards if zero_stage >= stage else trained

    nd = f"Nd={shards}"
    psi = f"Ψ/(tp·pp)={local:.4g}"
    if model.expert_params:
        psi = f"(Ψdense/(tp·pp) + Ψexperts/(ep·pp))={local:.4g}"
        nd += f", experts over Nd/ep={shards // ep}"
    params = weight_b * sharded(3)
    grads = grad_b * trained_sharded(2)
    optim = optim_b * trained_sharded(1)
    psi_t = psi if trainable_params is None else f"Ψtrained/(tp·pp)={trained:.4g} (adapters)"
    lines = [
        Line("params", params / GB, f"{weight_b}·{psi}" + (f"/{nd} (ZeRO-3)" if zero_stage >= 3 else "")),
        Line("grads", grads / GB, f"{grad_b}·{psi_t}" + (f"/{nd} (ZeRO-2+)" if zero_stage >= 2 else ""), "step"),
    ]
    if offload != "none":
        lines.append(Line("optimizer", 0.0, f"{optim_b}·Ψ' offloaded to {offload}: {optim / GB:.3g} GB off device"))
    else:
        lines.append(Line("optimizer", optim / GB, f"{optim_b}·{psi_t}" + (f"/{nd} (ZeRO-1+)" if zero_stage else "")))
    if reference == "copy":
        lines.append(
            Line(
                "reference",
                params / GB,
                f"a frozen copy: {weight_b}·{psi}" + (f"/{nd} (ZeRO-3)" if zero_stage >= 3 else ""),
            )
        )  # noqa: E501
    elif reference != "none":
        lines.append(Line("reference", 0.0, f"{reference}: no second copy of the weights"))
    head_trained = trainable_params is None  # (adapters: the head is frozen)
    activations, formula = activation_line(
        model, seq_len, micro_batch, precision, tp, pp, cp, sp, activation_checkpointing, dropout, zero_stage, recipe,
        head_trained,
    )  # fmt: skip
    lines.append(Line("activations", activations / GB, formula, "backward"))
    working, working_formula = backward_working_line(
        model, seq_len, micro_batch, precision, tp, cp, activation_checkpointing, recipe
    )
    if working:
        lines.append(Line("working set", working / GB, working_formula, "backward"))
    if mixed and recipe.weights == "autocast" and zero_stage < 3:
        lines.append(_autocast_copies(model, local, tp, activation_checkpointing))
    if activation_checkpointing == "full":
        layer = recomputed_layer_bytes(model, seq_len, micro_batch, precision, tp, cp, sp, dropout, zero_stage, recipe)
        lines.append(
            Line("recomputed layer", layer / GB, "one layer's activations while backward recomputes it", "step")
        )
    # (offloaded: the step runs where the states are)
    foreach = recipe.optimizer_step == "foreach" and optimizer == "adam" and offload == "none"
    temporaries = 4 * trained_sharded(1) if foreach else 0.0
    lines.append(Line("optimizer step", temporaries / GB, _step_formula(recipe, optimizer, temporaries), "step"))
    full_grads = grad_b * trained
    bucket = full_grads if zero_stage == 0 and not gradient_as_bucket_view else 0.0
    if zero_stage == 2 and shards > 1:  # buckets in flight during backward, each within one rank's chunk
        bucket = BUCKETS_IN_FLIGHT * min(zero_bucket_mb * 1e6, grads)
    unit = model.zero3_unit_params(tp, weight_b, zero3_unit_mb)
    lines.append(_buffers(model, zero_stage, dp, cp, tp, 2 if mixed else 4, bucket, ep, unit))
    lines.append(
        Line("runtime", runtime_gb, runtime_words if runtime_gb else "not counted (runtime_gb / --runtime-gb)")
    )
    kept = pp == 1 and shards > 1 and (zero_stage == 1 or zero_stage == 0 and gradient_as_bucket_view)
    host = optim / GB if offload == "cpu" else 0.0
    estimate = Estimate(lines, grads_meet_activations=kept, host_gb=host)
    peak = max(estimate.backward_gb, estimate.step_gb) - runtime_gb  # (of the tensors)
    share = recipe.allocator_allowance
    estimate.lines.append(
        Line("allocator", share * peak, f"{share:.0%} of the tensors: allocator rounding, kernel workspaces", "slack")
    )
    return estimate


def _autocast_copies(model: ModelShape, local: float, tp: int, recompute: Recompute) -> Line:
    """The 16-bit copies autocast makes of fp32 weights, kept for backward by each matrix product; under full
    recomputation a layer's are freed with its activations, and only the head's stay."""
    if recompute == "full":
        head = (model.vocab or 0) * (model.hidden or 0) / tp
        return Line("autocast copies", 2 * head / GB, "2·V·h/tp: the head's (layers recomputed)", "backward")
    return Line("autocast copies", 2 * local / GB, f"2·Ψ/(tp·pp)={local:.4g}: 16-bit copies of the weights", "backward")


def _step_formula(recipe: StepRecipe, optimizer: Optimizer, temporaries: float) -> str:
    if temporaries:
        return "foreach Adam: one fp32 tensor per optimizer state element (its √v)"
    return f"{recipe.optimizer_step} {optimizer} step: none"


def _buffers(
    model: ModelShape,
    zero_stage: int,
    dp: int,
    cp: int,
    tp: int,
    weight_b: int,
    bucket: float,
    ep: int = 1,
    unit: float = 0.0,
) -> Line:
    if zero_stage >= 3:
        layer = model.largest_layer_params or model.params / max(1, model.layers or 1)
        if model.moe_layers:  # an MoE block: its dense part split by tp, its experts (kept whole by tp) by ep
            bank = model.expert_params / model.moe_layers
            per_rank = (layer - bank) / tp + bank / ep
            gathered = 2 * weight_b * per_rank
            formula = f"2 gathered layers: 2·{weight_b}·((block − experts)/tp + experts/ep)={per_rank:.4g}"
            return Line("buffers", gathered / GB, formula)
        if unit > layer / tp:  # small blocks share a unit (sharding.unit_mb): the one in use and the next
            following = min(unit, max(0.0, layer / tp * (model.layers or 1) - unit))  # (none: one unit for all)
            formula = f"gathered units of sharding.unit_mb: {weight_b}·({unit:.4g} + next {following:.4g})"
            return Line("buffers", weight_b * (unit + following) / GB, formula)
        gathered = 2 * weight_b * layer / tp  # the layer in use and the one prefetched
        return Line("buffers", gathered / GB, f"2 gathered layers: 2·{weight_b}·{layer:.4g}/tp")
    if dp * cp > 1 and zero_stage == 0 and bucket:
        return Line("buffers", bucket / GB, "DDP gradient buckets: a copy of the gradients")
    if dp * cp > 1 and zero_stage == 2:
        return Line("buffers", bucket / GB, f"{BUCKETS_IN_FLIGHT} reduction buckets of min(zero.bucket_mb, 4Ψ/Nd)")
    return Line("buffers", 0.0, "none")


def _check_layout(model: ModelShape, zero_stage: int, dp: int, tp: int, pp: int, cp: int, ep: int = 1) -> None:
    if not 0 <= zero_stage <= 3:
        raise EstimateError(f"zero_stage={zero_stage}: choose 0, 1, 2 or 3")
    for name, size in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if size < 1:
            raise EstimateError(f"{name}={size}: sizes are 1 or more")
    if ep > 1 and ((dp * cp) % ep or (model.experts and model.experts % ep)):
        raise EstimateError(f"ep={ep} must divide dp·cp={dp * cp} and the {model.experts or '?'} experts")
    if model.heads is not None and (tp > model.heads or model.heads % tp):
        raise EstimateError(f"tp={tp} does not divide the {model.heads} attention heads")
    if model.layers is not None and pp > model.layers:
        raise EstimateError(f"pp={pp} is more than the {model.layers} layers: a stage would be empty")
    if model.params <= 0:
        raise EstimateError("the model has no parameters: give --params or a model config")


def as_table_rows(estimate: Estimate) -> list[tuple[str, str, str]]:
    rows = [(line.name, f"{line.gb:.3f}", line.formula) for line in estimate.lines]
    return [*rows, ("total", f"{estimate.total_gb:.3f}", estimate.total_formula)]
