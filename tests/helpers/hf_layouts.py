"""Train transformers models in several layouts of one gloo world; compare with one plain-torch process."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from meshkit import Engine
from meshkit.core.errors import MeshkitError
from tests.helpers.distributed import leave_world
from tests.helpers.hf_models import causal_lm
from tests.helpers.moe_models import MOE_FAMILIES, MORE_MOE_FAMILIES, TEST_VARIANTS, moe_causal_lm

STEPS, GLOBAL_BATCH, SEQ = 4, 4, 16
CLIP = 0.1  # small enough that every step of the test clips

# layout name -> engine overrides, each on a world of 4 ranks
LAYOUTS = {
    "tp2": {"tp": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "cp2": {"cp": 2},
    "pp2_1f1b": {"pp": 2, "schedule": "1f1b"},
    "pp2_tp2": {"pp": 2, "tp": 2, "schedule": "1f1b"},
    "fsdp2_tp2": {"tp": 2, "zero_stage": 3},
    "zero3_cp2": {"cp": 2, "zero_stage": 3},
    # beyond the support matrix, run on one family
    "pp2_cp2": {"pp": 2, "cp": 2, "schedule": "1f1b"},
    "tp2_cp2": {"tp": 2, "cp": 2},  # (the attention implementation ring attention selects reaches split attentions)
    "pp2_tp2_sp": {"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "1f1b"},
    "pp2_clipped": {"pp": 2, "schedule": "1f1b", "max_grad_norm": CLIP},  # tied copies counted once in the norm
    "ddp4": {},
    "zero3_4": {"zero_stage": 3},
    "zero1_4": {"zero_stage": 1},
    # expert parallel (mixture-of-experts models)
    "ep4": {"ep": 4},
    "ep2_dp2": {"ep": 2},
    "ep2_zero3": {"ep": 2, "zero_stage": 3},
    "ep4_zero3": {"ep": 4, "zero_stage": 3},
    "ep2_tp2": {"ep": 2, "tp": 2},
    "ep2_pp2": {"ep": 2, "pp": 2, "schedule": "1f1b"},
    "ep2_clipped": {"ep": 2, "max_grad_norm": CLIP},
    "ep2_zero1": {"ep": 2, "zero_stage": 1},  # ZeRO-1/2: each rank's experts chunked over the 2 ranks holding them
    "ep2_zero2": {"ep": 2, "zero_stage": 2},
    "ep2_zero2_clipped": {"ep": 2, "zero_stage": 2, "max_grad_norm": CLIP},
    "ep2_tp2_zero1_clipped": {"ep": 2, "tp": 2, "zero_stage": 1, "max_grad_norm": CLIP},  # banks whole over tp
    "ep2_pp2_zero2": {"ep": 2, "pp": 2, "zero_stage": 2, "schedule": "1f1b"},
    "ep4_capacity_ample": {"ep": 4, "capacity_factor": 4.0},
    "ep2_zero3_recompute": {"ep": 2, "zero_stage": 3, "activation_checkpointing": {"mode": "full"}},
    # the router's balancing loss over the global batch (what one process computes)
    "ddp4_global_aux": {"router_aux_loss": "global_batch"},
    "zero3_4_global_aux": {"zero_stage": 3, "router_aux_loss": "global_batch"},
    "ep4_global_aux": {"ep": 4, "router_aux_loss": "global_batch"},
    "ep2_dp2_global_aux": {"ep": 2, "router_aux_loss": "global_batch"},
    "ep2_zero3_global_aux": {"ep": 2, "zero_stage": 3, "router_aux_loss": "global_batch"},
    "ep2_zero2_global_aux": {"ep": 2, "zero_stage": 2, "router_aux_loss": "global_batch"},
    "ep2_tp2_global_aux": {"ep": 2, "tp": 2, "router_aux_loss": "global_batch"},
    "ep2_cp2_global_aux": {"ep": 2, "cp": 2, "router_aux_loss": "global_batch"},
    "pp2_global_aux": {"pp": 2, "schedule": "1f1b", "router_aux_loss": "global_batch"},
    "ep2_pp2_global_aux": {"ep": 2, "pp": 2, "schedule": "1f1b", "router_aux_loss": "global_batch"},
    "tp2_sp_global_aux": {"tp": 2, "sequence_parallel": True, "router_aux_loss": "global_batch"},
    "pp2_tp2_sp_global_aux": {
        "pp": 2,
        "tp": 2,
        "sequence_parallel": True,
        "schedule": "1f1b",
        "router_aux_loss": "global_batch",
    },
    "tp2_sp_aux": {"tp": 2, "sequence_parallel": True},  # per micro-batch: a micro-batch's sequences over 2 tp ranks
    "pp2_zbv_global_aux": {
        "pp": 2,
        "schedule": "zbv_zero_bubble",
        "microbatches": 2,
        "router_aux_loss": "global_batch",
    },  # refused: torch's V schedule has no forward-only pass
    "pp2_interleaved_global_aux": {"pp": 2, "schedule": "interleaved_1f1b", "router_aux_loss": "global_batch"},
    "pp2_interleaved_zb_global_aux": {
        "pp": 2,
        "schedule": "interleaved_zero_bubble",
        "router_aux_loss": "global_batch",
    },
    "pp2_gpipe_global_aux": {"pp": 2, "schedule": "gpipe", "router_aux_loss": "global_batch"},
    "pp2_recompute_global_aux": {
        "pp": 2,
        "schedule": "1f1b",
        "router_aux_loss": "global_batch",
        "activation_checkpointing": {"mode": "full"},
    },
    "pp2_cp2_global_aux": {"pp": 2, "cp": 2, "schedule": "1f1b", "router_aux_loss": "global_batch"},
    # packed rows: several samples per row, kept apart by position_ids restarting at 0 (sample_packing)
    "ddp4_packed": {"packed": True},  # train_step builds no cache, so the model keeps the samples apart itself
    "cp2_packed": {"cp": 2, "packed": True},
    "pp2_packed": {"pp": 2, "schedule": "1f1b", "packed": True},
    "pp2_cp2_packed": {"pp": 2, "cp": 2, "schedule": "1f1b", "packed": True},
    "zero3_cp2_packed": {"cp": 2, "zero_stage": 3, "packed": True},
    "ddp4_aux": {},  # per micro-batch: each rank's own (differs from one process)
    "cp2_aux": {"cp": 2},  # per micro-batch: a micro-batch's sequences are chunked over 2 cp ranks
    "pp2_aux": {"pp": 2, "schedule": "1f1b"},  # per pipeline micro-batch
}
MATRIX = ("tp2", "tp2_sp", "cp2", "pp2_1f1b", "pp2_tp2", "fsdp2_tp2", "zero3_cp2")


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model of `family`: a dense one (`hf_models`) or a mixture of experts (`moe_models`)."""
    moe = family in MOE_FAMILIES or family in MORE_MOE_FAMILIES or family in TEST_VARIANTS
    return moe_causal_lm(family, seed) if moe else causal_lm(family, seed)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum (gradient sync errors show at their true size), gentler than the GPT tests' lr so that
    4 steps do not amplify rounding differences of a different reduction order beyond 1e-5."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches(
    steps: int = STEPS, global_batch: int = GLOBAL_BATCH, seq: int = SEQ, packed: bool = False
) -> list[dict[str, torch.Tensor]]:
    """HF batches with labels = input_ids; counting sequences, so the loss falls within a few steps. Packed:
    each row holds samples of 3 to 8 tokens and a padding run, as `meshkit.data.packing` lays them out."""
    generator = torch.Generator().manual_seed(123)
    out = []
    for _ in range(steps):
        start = torch.randint(3, 40, (global_batch, 1), generator=generator)
        stride = torch.randint(1, 3, (global_batch, 1), generator=generator)
        ids = (start + stride * torch.arange(seq)) % 60 + 3
        batch = {"input_ids": ids, "labels": ids.clone()}
        out.append(_packed(batch, generator) if packed else batch)
    return out


def _packed(batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Cut each row into samples (positions restart at 0, no sample predicts the next one's start), then pad."""
    positions, labels = torch.zeros_like(batch["input_ids"]), batch["labels"].clone()
    for row in range(labels.shape[0]):
        begin = 0
        while begin < labels.shape[1] - 2:
            length = min(int(torch.randint(3, 9, (), generator=generator)), labels.shape[1] - begin)
            positions[row, begin : begin + length] = torch.arange(length)
            labels[row, begin] = -100
            begin += length
        positions[row, begin:] = torch.arange(labels.shape[1] - begin)  # padding: a run of its own
        labels[row, begin:] = -100
    return {**batch, "labels": labels, "position_ids": positions}


def reference_of(family: str, layout: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process run a layout's cell must equal (the same clipping, the same packed batches)."""
    settings = LAYOUTS[layout]
    return reference(family, settings.get("max_grad_norm"), settings.get("packed", False))


@functools.cache
def reference(
    family: str, max_grad_norm: float | None = None, packed: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The user's plain loop in one process: model(**batch).loss, backward, step."""
    model = build(family)
    return one_process(model, make_optimizer(model), batches(packed=packed), max_grad_norm)


def one_process(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    chosen: list[dict[str, torch.Tensor]],
    max_grad_norm: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of the plain loop (model(**batch).loss, backward, clip, step) in this process."""
    torch.set_num_threads(1)
    losses = []
    for batch in chosen:  # (transformers keeps packed samples apart only without a cache)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        if max_grad_norm is not None:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm) > max_grad_norm
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_families(rank: int, cells: dict[str, list[str]]) -> dict[tuple[str, str], dict]:
    """Each (family, layout)'s losses and full weights (or the one-line refusal) on this rank."""
    torch.distributed.init_process_group("gloo")
    out: dict[tuple[str, str], dict] = {}
    for family, layouts in cells.items():
        for name in layouts:
            out[family, name] = train_in_layout(family, LAYOUTS[name])
    leave_world()
    return out


def rank_part(engine: Engine, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This data-parallel rank's rows of a global batch."""
    local = GLOBAL_BATCH // engine.dp_size
    return {k: v[engine.dp_rank * local : (engine.dp_rank + 1) * local] for k, v in batch.items()}


def train_steps(engine: Engine, chosen: list[dict[str, torch.Tensor]]) -> list[float]:
    """train_step on this rank's part of each global batch; the step losses."""
    return [engine.train_step(rank_part(engine, batch)).item() for batch in chosen]


def train_in_layout(
    family: str,
    overrides: dict,
    builder: Callable[[str], torch.nn.Module] = build,
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = make_optimizer,
) -> dict:
    """Losses and full weights of `family` (made by `builder`) trained in the layout `overrides` (with
    "packed": True, on packed rows), or the one-line refusal (at prepare, or at the first forward)."""
    overrides = dict(overrides)
    packed = overrides.pop("packed", False)
    engine = Engine(seed=0, **overrides)
    model = builder(family)
    try:
        model, _ = engine.prepare(model, optimizer(model))
    except Exception as err:  # noqa: BLE001 - a refusal is a result: the test checks its message
        engine.end()
        return {"refused": str(err)}
    try:
        losses = train_steps(engine, batches(packed=packed))
    except MeshkitError as err:  # refused at the first forward (what only a forward shows), on every rank alike
        engine.end()
        return {"refused": str(err)}
    out = {"losses": losses, "state": engine.full_state_dict()}
    engine.end()
    return out


PACKED = ("ddp4_packed", "cp2_packed", "pp2_packed", "pp2_cp2_packed")
# Each group trains in one 4-rank world. mistral, gemma2 and gemma3 attend through a sliding window shorter than
# the sequence (gemma2 also soft-caps its logits): ring attention honours both.
GROUPS = {
    "llama-qwen2-gpt2": {
        "llama": [*MATRIX, "pp2_cp2", "pp2_tp2_sp", "tp2_cp2", *PACKED],
        "qwen2": list(MATRIX),
        "gpt2": [*MATRIX, "pp2_clipped"],
    },
    "qwen3-gemma3-gemma2": {
        "qwen3": [*MATRIX, "pp2_tp2_sp", "cp2_packed", "pp2_packed"],
        "gemma3": [*MATRIX, "cp2_packed"],  # packed rows through a sliding window
        "gemma2": ["tp2", "cp2", "zero3_cp2", "cp2_packed"],  # windows, soft-caps and packed rows at once
        "mistral": ["cp2", "zero3_cp2", "tp2_cp2", "cp2_packed", "pp2_packed"],
    },
    # fused layers split by their parts: Phi-3's q/k/v (unequal under GQA) and gate/up, GLM-4's gate/up
    "phi3-glm4": {"phi3": [*MATRIX, "tp2_cp2"], "glm4": list(MATRIX)},
    # families described by nothing but their shapes: no adapter entry (OLMo-2 normalises a whole projection,
    # split with its heads under tp; StableLM: partial rotary, LayerNorm, q/k/v biases; Granite: its multipliers)
    "olmo2-stablelm-granite": {"olmo2": list(MATRIX), "stablelm": list(MATRIX), "granite": list(MATRIX)},
    # OPT registers its final norm before its layers and flattens tokens in its MLP (SP refuses); GPT-J's fc_in/
    # fc_out/out_proj; Falcon's attention goes through transformers' attention functions (transformers 5.25; it
    # computed attention itself before, which cp refused) and its blocks return tuples; Nemotron's LayerNorm1P runs
    # on sequence shards under SP
    "opt-gptj-falcon-nemotron": {
        "opt": [*MATRIX, "tp2_sp"],
        "gptj": list(MATRIX),
        "falcon": ["cp2", "pp2_1f1b"],
        "nemotron": ["tp2_sp", "pp2_tp2_sp"],
    },
    # blocks that return tuples in a pipeline (Bloom, Falcon); Bloom's embedding norm belongs to the first stage.
    # Gemma 3 as published, a multimodal model on text batches: its vision tower (more layers than the text model)
    # gets no gradient, in every layout
    "bloom-gemma3_vision": {"bloom": ["pp2_1f1b", "cp2"], "gemma3_vision": [*MATRIX, "ddp4", "zero3_4"]},
}
TESTED = {family: layouts for group in GROUPS.values() for family, layouts in group.items()}
# (family, layout) -> the words of meshkit's one-line refusal; every other cell must match the reference
REFUSED: dict[tuple[str, str], str] = {
    ("opt", "tp2_sp"): "by the model, so they cannot be split on the sequence: set tensor_parallel.sequence_parallel",
    ("bloom", "cp2"): "BloomForCausalLM.forward takes none that meshkit knows",  # (positions by ALiBi)
}
COLUMNS = {
    "tp2": "tp 2",
    "tp2_sp": "tp 2 + SP",
    "cp2": "cp 2",
    "pp2_1f1b": "pp 2 (1F1B)",
    "pp2_tp2": "pp 2 × tp 2",
    "fsdp2_tp2": "FSDP 2 × tp 2",
    "zero3_cp2": "ZeRO-3 + cp 2",
    "cp2_packed": "cp 2, packed",
    "pp2_packed": "pp 2, packed",
}


def render_matrix() -> str:
    """The support matrix of docs/any-model.md: what the layout tests check, cell by cell."""
    header = "| family | " + " | ".join(COLUMNS.values()) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 1)]
    for family, layouts in TESTED.items():
        cells = [
            "refused¹" if (family, layout) in REFUSED else "✓" if layout in layouts else "not run" for layout in COLUMNS
        ]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
