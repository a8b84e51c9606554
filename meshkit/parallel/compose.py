"""The composition layer: apply the strategies of a run to a model, always in the same order.

Order (each step relies on the previous one's result): pipeline split -> tensor/sequence parallel -> context
parallel -> expert parallel -> activation checkpointing -> compile -> FSDP or DDP. Compile comes before the
data-parallel wrapper so that DDP's bucket hooks see the compiled module and FSDP shards compiled blocks. A model
built on the meta device is materialised once every split is done (only this rank's shards are ever allocated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from meshkit.config.layout import PipelineError
from meshkit.config.schema import DDPConfig, RunConfig
from meshkit.models.block_flow import carried_between_blocks
from meshkit.models.facts import has_meta_tensors
from meshkit.models.gpt import GPT
from meshkit.models.layer_roles import LayerRoles, layer_roles, sample_forward
from meshkit.models.logits_head import LogitsHead, logits_head
from meshkit.models.own_loss import OwnLoss, own_loss
from meshkit.models.structure import ModelStructure, describe
from meshkit.models.token_wise import token_wise_mlps
from meshkit.models.usage import parameters_without_gradient
from meshkit.parallel.activation import CheckpointedBlock, apply_activation_checkpointing
from meshkit.parallel.compile import apply_compile
from meshkit.parallel.context.apply import apply_context_parallel
from meshkit.parallel.dataparallel import apply_dataparallel
from meshkit.parallel.ddp import apply_ddp
from meshkit.parallel.expert.apply import apply_expert_parallel
from meshkit.parallel.fsdp import apply_fsdp
from meshkit.parallel.layout_fit import check_layout_fits
from meshkit.parallel.materialize import load_safetensors, materialize
from meshkit.parallel.pipeline.stages import PipelineModel, chunks_per_rank, split_model, stage_ids
from meshkit.parallel.routed import tie_expert_banks
from meshkit.parallel.tensor.apply import apply_tensor_parallel
from meshkit.parallel.tensor.storage import SplitWeights
from meshkit.parallel.tiled_mlp import apply_tiled_mlp
from meshkit.runtime.mesh import ParallelMesh
from meshkit.training.precision import autocast_forward


@dataclass
class Parallelized:
    """A prepared model and what the engine must know about how it was split."""

    model: nn.Module
    structure: ModelStructure | None = None  # what the model is made of (from the model-structure layer)
    split_weights: SplitWeights = field(default_factory=SplitWeights)  # how tensor parallel stores fused weights
    logits_sharded: bool = False  # the model returns vocab-sharded logits: compute the loss under loss_parallel
    partial_over_tp: list[str] = field(default_factory=list)  # gradients summed over tp after backward
    needs_gradient_reduce: bool = False  # data parallel that no wrapper reduces (DTensor parameters)
    checkpointed: list[CheckpointedBlock] = field(default_factory=list)  # blocks with checkpointing/offload
    experts: list[nn.Module] = field(default_factory=list)  # expert banks split over ep (their gradients: edp)
    notice: str | None = None  # one line for the user about how the layout was applied
    own_loss: OwnLoss | None = None  # how the model's own loss reads its labels (learnt on the whole model)
    logits_head: LogitsHead | None = None  # the head whose output the logits are, or why not (whole model, too)
    compiled: str = "off"  # how torch.compile was applied: off, whole model, per block (N blocks)
    tiled_mlp: str | None = None  # the MLPs tiled over the sequence, in words, or why none (None: not asked)
    routed_banks: list[nn.Module] = field(default_factory=list)  # expert banks tied into every step's reduction


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    config: RunConfig,
    zero_stage: int,
    frozen: bool = False,
    reduce_gradients: bool = True,
) -> Parallelized:
    """Place `model` on this rank's device and split and wrap it for the run's layout and precision.

    `zero_stage` is the stage in effect (0 when there is a single data-parallel rank). Stages 1 and 2 leave the
    model as it is: their sharding lives in the optimizer (`meshkit.parallel.zero.optimizer`). Under pipeline parallel
    the model is first cut into this rank's stages, and each goes through the same chain. `frozen`: a model that
    only runs forward (a reference model): split and sharded alike, but no recomputation and no gradient wrapper.
    `reduce_gradients`: whether the data-parallel ranks average gradients here (False where a parameter server's
    servers average them: no DDP wrapper).
    """
    structure = describe(model, config.blocks, config.structure)
    pp = mesh.size("pp")
    notice = None
    own = None if frozen else own_loss(model, structure)  # (before any layout changes the forward)
    head = logits_head(model, structure) if structure.causal_lm else None  # (on the meta device too)
    tiled = token_wise_mlps(model, structure) if config.tiled_mlp and not frozen else ()
    untiled = "no block MLP computes each token on its own here: the MLPs run whole"
    if config.tiled_mlp and not frozen and not tiled:
        notice = f"meshkit: tiled_mlp: {untiled}"
    check_layout_fits(model, structure, mesh.dims, config)
    if mesh.dims.ep > 1 and not structure.moe:
        notice = f"meshkit: parallel.ep={mesh.dims.ep} changes nothing: the model has no mixture-of-experts blocks"
    if config.strategy == "dataparallel":  # one process: the wrapper replicates the model on every forward
        result = _parallelize_one(model, mesh, config, zero_stage, structure, autocast=False)
        result.model, result.notice = apply_dataparallel(result.model, mesh.device)
        autocast_forward(result.model, config.precision, mesh.device.type)  # autocast reaches its replica threads
        result.own_loss, result.logits_head = own, head
        return result
    if pp == 1:
        eager = head.name if head is not None and config.fused_loss != "off" and config.strategy == "auto" else None
        result = _parallelize_one(
            model, mesh, config, zero_stage, structure, frozen=frozen, tiled=tiled, eager_head=eager,
            reduce_gradients=reduce_gradients,
        )  # fmt: skip
        result.notice, result.own_loss, result.logits_head = result.notice or notice, own, head
        result.tiled_mlp = result.tiled_mlp or (f"not applied: {untiled}" if config.tiled_mlp and not frozen else None)
        return result
    carried = (
        carried_between_blocks(model, structure, sample_forward(model, structure, keep_mode=True))
        if structure.blocks
        else None
    )
    if carried is not None:
        raise PipelineError(
            f"pipeline parallel: {carried}, and a stage hands the next one its last block's hidden states only: "
            "use pp=1"
        )
    chunks = chunks_per_rank(config.pipeline)
    roles = _roles(model, structure, config) if mesh.size("tp") > 1 else None  # (learnt on the whole model)
    stage_list = stage_ids(mesh.coordinate("pp"), pp, chunks, config.pipeline.schedule)
    stage_modules = split_model(model, stage_list, pp * chunks, structure)
    parts = [_parallelize_one(m, mesh, config, zero_stage, structure, in_pipeline=True, roles=roles, tiled=tiled,
                              reduce_gradients=reduce_gradients) for m in stage_modules]  # fmt: skip
    return Parallelized(
        PipelineModel([part.model for part in parts], stage_list, pp * chunks),
        structure=structure,
        split_weights=SplitWeights.union((part.split_weights for part in parts), mesh.size("tp")),
        logits_sharded=any(part.logits_sharded for part in parts),
        partial_over_tp=[name for part in parts for name in part.partial_over_tp],
        needs_gradient_reduce=any(part.needs_gradient_reduce for part in parts),
        checkpointed=[block for part in parts for block in part.checkpointed],
        experts=[bank for part in parts for bank in part.experts],
        routed_banks=[bank for part in parts for bank in part.routed_banks],
        notice=notice or next((part.notice for part in parts if part.notice), None),
        own_loss=own,
        logits_head=head,
        tiled_mlp=next((part.tiled_mlp for part in parts if part.tiled_mlp), None)
        or (f"not applied: {untiled}" if config.tiled_mlp and not frozen else None),
        compiled=parts[0].compiled if parts else "off",
    )


def _roles(model: nn.Module, structure: ModelStructure, config: RunConfig) -> LayerRoles | None:
    """The layers' roles for tensor parallel (None where the user's plan or the reference GPT's decides)."""
    if config.tensor_parallel.plan is not None or isinstance(model, GPT):
        return None
    return layer_roles(model, structure)


def _parallelize_one(
    model: nn.Module,
    mesh: ParallelMesh,
    config: RunConfig,
    zero_stage: int,
    structure: ModelStructure,
    in_pipeline: bool = False,
    autocast: bool = True,
    frozen: bool = False,
    roles: LayerRoles | None = None,
    tiled: tuple[str, ...] = (),
    eager_head: str | None = None,
    reduce_gradients: bool = True,
) -> Parallelized:
    sharding = config.sharding
    on_meta = has_meta_tensors(model)
    if not on_meta:
        model = model.to(mesh.device)
        if sharding.init_from is not None:
            load_safetensors(
                model,
                sharding.init_from,
                stage_only=in_pipeline,
                aliases=structure.aliases(),
                vocabulary=structure.vocabulary,
            )
    ddp = zero_stage == 0 and mesh.grad_size > 1 and reduce_gradients and not frozen
    ddp = ddp and mesh.size("tp") == 1 and not in_pipeline
    # (learnt from a forward of the model as given, before any layout's hooks see a first call)
    ddp_settings = _ddp_settings(config, model, structure) if ddp else config.ddp
    result = Parallelized(model, structure)
    tp = mesh.size("tp")
    if tp > 1:
        split = apply_tensor_parallel(model, mesh.device_mesh["tp"], config.tensor_parallel, structure, roles)
        result.split_weights, result.logits_sharded = split.split_weights, split.logits_sharded
        result.partial_over_tp, result.notice = split.partial_over_tp, split.note
    if mesh.size("cp") > 1:
        apply_context_parallel(model, mesh.group("cp"), structure)
    if mesh.dims.ep > 1:
        ep_mesh, edp_mesh = mesh.expert_dim("ep"), mesh.expert_dim("edp")
        result.experts = apply_expert_parallel(model, ep_mesh, edp_mesh, config.moe.capacity_factor)
    count = apply_tiled_mlp(model, tiled, config.tiled_mlp_shards)  # (inside the blocks: checkpointing wraps it)
    if count:
        result.tiled_mlp = f"{count} MLP{'s' * (count != 1)} over slices of the sequence"
    # DDP's and FSDP's reductions need every rank's banks in the graph, also where no token reached them here
    # (a pipeline's or tensor parallel's own all-reduce agrees on the gradients present instead)
    reduced_by_wrapper = zero_stage == 3 or (zero_stage == 0 and mesh.size("tp") == 1)
    if mesh.grad_size > 1 and mesh.dims.ep == 1 and reduced_by_wrapper and not in_pipeline and not frozen:
        result.routed_banks = tie_expert_banks(model, structure)
    if not frozen:  # (recomputation only pays where a backward runs)
        result.checkpointed = apply_activation_checkpointing(
            model, config.activation_checkpointing, config.activation_offload, mesh.device, structure.blocks
        )
    hooked = zero_stage == 3 or tp > 1 or in_pipeline
    result.compiled = apply_compile(model, config.compile, structure.blocks, hooked, eager_head)
    if zero_stage == 3:
        model = apply_fsdp(model, mesh, sharding, config.precision, structure.blocks, result.experts)
    if on_meta:
        materialize(
            model,
            mesh.device,
            sharding.init_from,
            stage_only=in_pipeline,
            aliases=structure.aliases(),
            split_weights=result.split_weights,  # split while on meta: fused weights reordered as they stream in
            vocabulary=structure.vocabulary,
        )
    if zero_stage == 0 and mesh.grad_size > 1 and reduce_gradients and not frozen:
        # DDP cannot wrap DTensor parameters, and a pipeline schedule runs several backward passes per step
        # that DDP's bucket rebuild does not expect: those gradients are averaged once after the step instead.
        if tp > 1 or in_pipeline:
            result.needs_gradient_reduce = True
        else:
            model = apply_ddp(model, mesh, ddp_settings, ignored=result.experts)
            if config.ddp.static_graph and config.grad_accum_steps > 1:
                result.notice = (
                    f"meshkit: ddp.static_graph with grad_accum_steps={config.grad_accum_steps}: gradients are "
                    "all-reduced on every micro-step (torch's no_sync fails under a static graph); the same "
                    "gradients, with more traffic, overlapped with backward"
                )
    if autocast:
        autocast_forward(model, config.precision, mesh.device.type)
    result.model = model
    return result


def _ddp_settings(config: RunConfig, model: nn.Module, structure: ModelStructure) -> DDPConfig:
    """`ddp:` as given, but looking for unused parameters where trainable encoders sit beside the text model (a
    multimodal model's vision tower gets no gradient from a text batch) or a forward leaves some trainable
    parameters without a gradient (`models/usage.py`)."""
    if config.ddp.find_unused_parameters:
        return config.ddp
    towers = [param for name in structure.towers for param in model.get_submodule(name).parameters()]
    if not any(param.requires_grad for param in towers) and not parameters_without_gradient(model, structure):
        return config.ddp
    return config.ddp.model_copy(update={"find_unused_parameters": True})


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under the DDP, DataParallel and torch.compile wrappers (FSDP2 shards in place)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(original := getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = original
        else:
            return model
