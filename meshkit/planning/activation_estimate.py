"""Activations a training step keeps for backward, per layer and in all, for the estimator (`estimate.py`).

Two counts. A modern decoder whose widths are known (RMSNorm, attention with grouped K/V heads, a gated MLP or
routed experts; `ModelShape.ffn` set) is counted tensor by tensor as autograd saves it — the count checked
against saved-tensor hooks on transformers' Llama, Qwen2 and Mixtral (tests/planning/test_activation_estimate.py).
Otherwise Korthikanti et al. (2022): sbh(34 + 5as/h) bytes per layer at 16 bits with dropout (GPT-style, 4h MLP).
"""

from __future__ import annotations

from typing import Any

from meshkit.config.layout import Recompute
from meshkit.planning.step_recipe import StepRecipe, loss_bytes


def layer_activation_bytes(
    *, s: float, b: int, h: int, a: int, element: int, tp: int, sp: bool, recompute: Recompute, dropout: bool,
    scores_kept: bool = True,
) -> float:  # fmt: skip
    """Bytes one transformer layer saves for backward (Korthikanti et al., generalised to any element size);
    `scores_kept=False`: a fused attention kernel keeps a fp32 log-sum-exp per head instead of the scores."""
    mask = 1 if dropout else 0
    if recompute == "full":
        return s * b * h * element / (tp if sp else 1)
    replicated = s * b * h * (4 * element + 2 * mask)  # layer-norm inputs, dropout masks (sharded only by SP)
    split = s * b * h * 12 * element
    scores = 0.0 if recompute == "selective" else a * s * s * b * (2 * element + mask)
    if not scores_kept and recompute == "none":
        scores = a * s * b * 4.0
    if sp:
        return (replicated + split + scores) / tp
    return replicated + split / tp + scores / tp


def decoder_layer_activation_bytes(
    *,
    s: float,
    b: int,
    h: int,
    kv_width: int,
    a: int,
    ffn: int,
    element: int,
    autocast: bool,
    tp: int,
    sp: bool,
    recompute: Recompute,
    fused_attention: bool = True,
    experts: tuple[int, int] | None = None,
    compiled: bool = False,
    tiled_mlp: bool = False,
) -> float:
    """Bytes one pre-norm decoder layer (RMSNorm, attention with `kv_width` = kv heads × head_dim, gated MLP of
    width `ffn`, or `experts` = (top_k, expert width)) saves for backward, per the tensors autograd keeps,
    measured with saved-tensor hooks on transformers' Llama, Qwen2 and Mixtral (tests/planning/
    test_activation_estimate.py). Per token, in elements: the two norms keep their input, normalised value and
    output (6h, whole on every tp rank unless SP); attention keeps q, its output (2h) and k, v (2·kv_width);
    the gated MLP its gate, activation, up and product (4·ffn), a routed MLP for each of its top-k experts that and
    the token's copy in and out (k·(4·f_e + 2h), experts kept whole by tp); fused attention keeps a fp32
    log-sum-exp per head, eager attention its probabilities (a·s) and k, v repeated to every head. Under autocast
    the residual stream stays fp32: its copies add 14h bytes. `compiled` (torch.compile's inductor, a dense layer):
    pointwise results are recomputed in backward, so a layer keeps the two norms' inputs (fp32 under autocast), the
    projections' normalised inputs (2h), q, k, v and the attention output (2h + 2·kv_width), the MLP's gate, up and
    product (3·ffn): on an H200 the 1.1 B model's peaks agree within 5 % (`step_recipe.py`). `tiled_mlp`: a dense
    MLP keeps only its input (the norm's output, counted with the norms); one slice's intermediates are counted
    once per step (`tiled_mlp_slice_bytes`)."""
    if recompute == "full":
        return s * b * h * (4 if autocast else element) / (tp if sp else 1)
    mlp = experts[0] * (4 * experts[1] + 2 * h) if experts else 0 if tiled_mlp else 4 * ffn
    split = 2 * h + 2 * kv_width + (0 if experts else mlp)
    whole = 6 * h + (mlp if experts else 0)  # (experts: whole under tp, as meshkit keeps the banks)
    # fused: a fp32 log-sum-exp per head (in elements of `element` bytes); eager: probabilities, k/v repeated
    scores = 4 * a / element if fused_attention or recompute == "selective" else a * s + 2 * (h - kv_width)
    stream = 14 * h if autocast else 0  # (the residual stream: sequence-sharded under SP, whole without)
    if compiled and not experts:
        split = 2 * h + 2 * kv_width + (0 if tiled_mlp else 3 * ffn)
        whole = 2 * h + (0 if autocast else 2 * h)  # (the norms' inputs: fp32 in `stream` under autocast)
        stream = 8 * h if autocast else 0
    per_token = element * (whole / (tp if sp else 1) + (split + scores) / tp) + stream / (tp if sp else 1) + 8
    if experts and element == 2:  # the expert kernels run outside autocast's casts (measured: fp32 on CPU)
        per_token += 2 * mlp
    return s * b * per_token


def _per_layer(
    model: Any, s: float, b: int, element: int, autocast: bool, tp: int, sp: bool, recompute: Recompute,
    dropout: bool, recipe: StepRecipe,
) -> float:  # fmt: skip
    """Bytes one layer keeps (averaged over dense and MoE layers)."""
    if model.ffn is not None and not dropout:  # a modern decoder, its widths known
        kv_width = (model.kv_heads or model.heads) * (model.hidden // model.heads)
        shape: dict[str, Any] = {"s": s, "b": b, "h": model.hidden, "kv_width": kv_width, "a": model.heads}
        fused = model.fused_attention and not recipe.keeps_scores
        layout: dict[str, Any] = {"element": element, "autocast": autocast, "tp": tp, "sp": sp, "recompute": recompute}
        kernel: dict[str, Any] = {"fused_attention": fused, "compiled": recipe.compiled}
        dense = decoder_layer_activation_bytes(**shape, ffn=model.ffn, **layout, **kernel, tiled_mlp=recipe.tiled_mlp)
        routed = (model.top_k or 1, model.expert_ffn or model.ffn) if model.moe_layers else None
        moe = decoder_layer_activation_bytes(**shape, ffn=model.ffn, **layout, **kernel, experts=routed)
        return float((dense * (model.layers - model.moe_layers) + moe * model.moe_layers) / model.layers)
    return layer_activation_bytes(
        s=s, b=b, h=model.hidden, a=model.heads, element=element, tp=tp, sp=sp, recompute=recompute, dropout=dropout,
        scores_kept=recipe.keeps_scores or not model.fused_attention,
    )  # fmt: skip


MIN_SLICE_TOKENS = 1024  # (as `meshkit.parallel.tiled_mlp` slices: max(hidden, 1024) tokens)


def backward_working_line(
    model: Any, seq_len: int, micro_batch: int, precision: str, tp: int, cp: int, recompute: Recompute,
    recipe: StepRecipe,
) -> tuple[float, str]:  # fmt: skip
    """(bytes, formula) of backward's working set (`backward_working_bytes`) at the run's shapes; none under full
    recomputation (the recomputed layer's line holds it) or where the widths are unknown."""
    if model.hidden is None or recompute == "full":
        return 0.0, ""
    element = 4 if precision == "fp32" else 2
    tiled = recipe.tiled_mlp and model.ffn is not None and model.moe_layers < model.layers
    bytes_ = backward_working_bytes(model, seq_len / cp, micro_batch, element, tp, tiled)
    if tiled:
        return bytes_, f"one MLP slice recomputed in backward: b·max(h, {MIN_SLICE_TOKENS})·6·ffn/tp"
    return bytes_, "the gradients of one layer's two widest tensors in backward: sb·2·ffn/tp"


def backward_working_bytes(model: Any, s: float, b: int, element: int, tp: int, tiled_mlp: bool) -> float:
    """What backward holds beyond the saved activations while it runs through one layer's MLP: the gradients of
    its two widest tensors (measured with a live-tensor count on transformers' Llama MLP: 2·ffn per token). Under
    tiled MLPs: one slice of max(h, 1024) tokens recomputed — its gate, activation, up and product and those two."""
    width = model.ffn or 4 * (model.hidden or 0)
    if tiled_mlp and model.ffn is not None:
        return b * min(s, max(model.hidden or 0, MIN_SLICE_TOKENS)) * 6 * width * element / tp
    return b * s * 2 * width * element / tp


def recomputed_layer_bytes(
    model: Any, seq_len: int, micro_batch: int, precision: str, tp: int, cp: int, sp: bool, dropout: bool,
    zero_stage: int = 0, recipe: StepRecipe | None = None,
) -> float:  # fmt: skip
    """Under full recomputation: what one layer keeps while backward recomputes it (the step's other peak)."""
    if model.layers is None or model.hidden is None or model.heads is None:
        return 0.0
    element = 4 if precision == "fp32" else 2
    autocast = element == 2 and zero_stage < 3
    return _per_layer(
        model, seq_len / cp, micro_batch, element, autocast, tp, sp, "none", dropout, recipe or StepRecipe()
    )  # fmt: skip


def activation_line(
    model: Any,
    seq_len: int,
    micro_batch: int,
    precision: str,
    tp: int,
    pp: int,
    cp: int,
    sp: bool,
    recompute: Recompute,
    dropout: bool,
    zero_stage: int = 0,
    recipe: StepRecipe | None = None,
    head_trained: bool = True,
) -> tuple[float, str]:
    """(bytes, formula) of the activations a rank holds at its peak, the loss's backward included. Under bf16/fp16
    the weights of ZeRO 0-2 stay fp32 and autocast casts them, so the residual stream is fp32; ZeRO-3 gathers bf16
    weights (its mixed-precision policy): the stream is bf16 too."""
    if model.layers is None or model.hidden is None or model.heads is None:
        return 0.0, "unknown: give --layers, --hidden and --heads"
    recipe = recipe or StepRecipe()
    element = 4 if precision == "fp32" else 2
    s = seq_len / cp
    autocast = element == 2 and zero_stage < 3
    per_layer = _per_layer(model, s, micro_batch, element, autocast, tp, sp, recompute, dropout, recipe)
    if cp > 1:  # the log-sum-exp kept per layer, and one layer's ring backward in flight (fp32 dq, dk/dv twice,
        # the K/V block and the next one arriving, the probabilities and their gradient for one block pair)
        sbh = s * micro_batch * model.hidden
        per_layer += model.heads * s * micro_batch * 4 / tp
        ring = (4 * 5 * sbh + 2 * 2 * element * sbh) / tp + 2 * model.heads * (s / 2) ** 2 * micro_batch * 4 / tp
    else:
        ring = 0.0
    in_flight_layers = model.layers  # first stage: pp micro-batches of L/pp layers
    loss, loss_formula = loss_bytes(s * micro_batch, model.vocab, model.hidden, tp, recipe.loss, element, head_trained)
    total = per_layer * in_flight_layers + (loss if pp == 1 else 0.0) + ring
    scores_kept = recipe.keeps_scores or not model.fused_attention
    term = {
        "none": f"sbh({16 * element}{'+2' if dropout else ''} + {2 * element + (1 if dropout else 0)}·as/h)"
        if scores_kept
        else f"sbh·{16 * element}{'+2' if dropout else ''} + 4·as·b (fused attention: a log-sum-exp, no scores)",
        "selective": f"sbh·{16 * element}{'+2' if dropout else ''} (attention scores recomputed)",
        "full": f"sbh·{element} (layer input only)",
    }[recompute]
    if model.ffn is not None and not dropout and recompute != "full":
        mlp = f"{model.top_k}·(4·{model.expert_ffn} + 2h) routed" if model.moe_layers else f"4·ffn={4 * model.ffn}"
        mlp = "0·ffn (tiled MLP)" if recipe.tiled_mlp and not model.moe_layers else mlp
        kernel = "a·s probabilities" if scores_kept else "lse"
        if recipe.compiled and not model.moe_layers:
            ffn = "0·ffn (tiled MLP)" if recipe.tiled_mlp else f"3·ffn={3 * model.ffn}"
            term = f"sb·{element}·(4h + 2·kv + {ffn}) + {kernel}, compiled"
            term += " + 8h bytes (fp32 norm inputs)" if autocast else ""
        else:
            term = f"sb·{element}·(8h + 2·kv + {mlp}) + {kernel}" + (" + 14h bytes (fp32 residual)" if autocast else "")
    split = f"/tp={tp}" + (" (SP)" if sp else " (part)") if tp > 1 else ""
    formula = (
        f"L={model.layers} × {term}{split}, s=seq/cp={s:g}, b={micro_batch}, h={model.hidden}, a={model.heads}"
        + (loss_formula if pp == 1 else "")
        + (" + lse and one layer's ring backward in flight (cp)" if cp > 1 else "")
    )
    return total, formula
