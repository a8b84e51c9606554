"""`Engine.prepare()`'s work: every model laid out by the composition layer, every optimizer rebound and
sharded, every loader split over the data-parallel ranks; what each produced is kept in `ctx.objects`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from meshkit.config.schema import RunConfig
from meshkit.engine.context import EngineComponent, EngineContext, print_once_per_node
from meshkit.engine.data import prepare_loader
from meshkit.engine.gradients import GradientSync
from meshkit.engine.prepared_objects import EngineError
from meshkit.models.adapters import lora_merges
from meshkit.models.embeddings import input_embedding
from meshkit.models.logits_head import logits_head
from meshkit.models.structure import describe
from meshkit.parallel.applied import check_tensor_parallel_split
from meshkit.parallel.compile import dynamo_counts
from meshkit.parallel.compose import Parallelized, parallelize, unwrap
from meshkit.parallel.dataparallel import bare_module
from meshkit.parallel.pipeline.router_balance import PipelineBalancing
from meshkit.parallel.pipeline.stages import PipelineModel
from meshkit.parallel.pipeline.tied import TiedAcrossStages
from meshkit.parallel.replicate import GradientAllReduce
from meshkit.parallel.routed import UnreachedBanks
from meshkit.parallel.sequence_seen import watch_sequence
from meshkit.parallel.tensor.consistency import WholeGradientsAgree
from meshkit.parallel.zero.sharding import rebind_params, renamed_parameters, shard_optimizer
from meshkit.runtime.hang_doctor import watched
from meshkit.runtime.memory import current_rss_bytes
from meshkit.training.accumulation import PreparedOptimizer, PreparedScheduler
from meshkit.training.fused_head import FusedHead
from meshkit.training.loss import CausalLMLoss, LossFn
from meshkit.training.neftune import add_embedding_noise
from meshkit.training.router_loss import balancing_group, balancing_loss


class Preparation(EngineComponent):
    def __init__(self, ctx: EngineContext, gradients: Callable[[], GradientSync], after_step: Callable[[], None]):
        super().__init__(ctx)
        self._gradients = gradients  # (made again with the layout)
        self._after_step = after_step  # host memory handed back after each optimizer step

    @watched("prepare")
    def prepare(self, objects: tuple[Any, ...], loss_fn: LossFn | None) -> Any:
        """Models first (an optimizer or scheduler must see the model's final parameters); the same order back."""
        if loss_fn is not None:
            self.ctx.objects.loss_fn = loss_fn
        registry = self.ctx.objects
        registry.start_rss = registry.start_rss or current_rss_bytes()  # (what the run's tensors add comes on top)
        prepared: dict[int, Any] = {}
        for index, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                prepared[index] = self._model(obj)
                registry.models.append(prepared[index])
        for index, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                continue
            if isinstance(obj, torch.optim.Optimizer):
                prepared[index] = self._optimizer(obj)
                registry.optimizers.append(prepared[index])
            elif isinstance(obj, DataLoader):
                prepared[index] = prepare_loader(self.ctx, obj)
                registry.loaders.append(prepared[index])
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or hasattr(obj, "get_last_lr"):
                prepared[index] = PreparedScheduler(obj, self.ctx.gradient_state)
                registry.schedulers.append(prepared[index])
            else:
                raise EngineError(
                    f"prepare() takes models, optimizers, DataLoaders and LR schedulers, not {type(obj).__name__}"
                )
        result = [prepared[i] for i in range(len(objects))]
        return result[0] if len(result) == 1 else tuple(result)

    def _model(self, model: nn.Module) -> nn.Module:
        ctx, objects, gradients = self.ctx, self.ctx.objects, self._gradients()
        model = bare_module(model, ctx.config.strategy)
        originals = list(model.named_parameters(remove_duplicate=False))  # tied weights: every name
        merges = lora_merges(model)  # before a pipeline split: the whole model's adapter layers
        objects.whole_parameters += sum(param.numel() for param in model.parameters())
        if ctx.config.compile.enabled and objects.compile_counts is None:
            objects.compile_counts = dynamo_counts()  # (graphs and breaks are counted from here)
        done = parallelize(
            model, ctx.mesh, ctx.config, ctx.placement.zero_stage, reduce_gradients=ctx.placement.shares_gradients
        )
        family = done.structure.family if done.structure else None
        split_notice = check_tensor_parallel_split(done.model, ctx.mesh.size("tp"), family or type(model).__name__)
        if split_notice:
            print_once_per_node(ctx.info, split_notice)
        now = dict(unwrap(done.model).named_parameters(remove_duplicate=False))
        objects.renamed_params.update(renamed_parameters(originals, now))
        objects.logits_sharded |= done.logits_sharded
        objects.split_weights[id(done.model)] = done.split_weights
        objects.adapter_merges[id(done.model)] = merges
        objects.user_modules[id(done.model)] = model
        objects.tied_aliases[id(done.model)] = done.structure.aliases() if done.structure else {}
        objects.causal_lm = done.structure is not None and done.structure.causal_lm  # HF batches get the LM loss
        if objects.causal_lm and objects.loss_fn is None and done.own_loss is not None:
            objects.causal_lm, objects.label_shift = self._own_loss_kept(done)
        objects.fused_head = self._fused_head(done)
        self._embedding_noise(done)
        objects.classifier = done.structure.classifier if done.structure else None
        objects.training_inputs = dict(done.structure.training_inputs) if done.structure else {}
        if done.structure is not None:
            structure, tp = done.structure, ctx.mesh.size("tp")
            loss = balancing_loss(structure.router_loss, structure.moe, ctx.config.moe.router_aux_loss)
            if loss is not None and tp > 1 and ctx.config.tensor_parallel.sequence_parallel:
                loss = replace(
                    loss, sequence_shards=tp, shard=ctx.mesh.coordinate("tp"), shard_group=ctx.mesh.group("tp")
                )
            objects.balancing = (loss, balancing_group(loss, ctx.mesh, ctx.placement.grad_group) if loss else None)
        if done.notice:
            print_once_per_node(ctx.info, done.notice)
        objects.checkpointed.extend(done.checkpointed)
        objects.compiled = done.compiled
        objects.tiled_mlp = done.tiled_mlp
        tp, cp = ctx.mesh.size("tp"), ctx.mesh.size("cp")
        if (tp > 1 or cp > 1) and not isinstance(done.model, PipelineModel):  # (the record: the sequence a block sees)
            shards = tp if tp > 1 and ctx.config.tensor_parallel.sequence_parallel else 1
            objects.sequence_seen = watch_sequence(unwrap(done.model), ctx.config.blocks, cp, shards)
        if done.partial_over_tp:
            partial = [now[name] for name in done.partial_over_tp if name in now]
            gradients.model_reducers.append(GradientAllReduce(partial, ctx.mesh.group("tp"), average=False))
        experts = {id(param) for bank in done.experts for param in bank.parameters()}
        objects.expert_params |= experts  # (ZeRO-1/2 chunk them over edp)
        if done.needs_gradient_reduce:
            others = [param for param in now.values() if id(param) not in experts]
            gradients.model_reducers.append(GradientAllReduce(others, ctx.mesh.grad_group))
        if done.routed_banks:  # (after every other reducer: the banks no rank's tokens reached lose their zeros)
            gradients.model_reducers.append(UnreachedBanks(done.routed_banks, ctx.mesh.grad_group))
        if experts and ctx.placement.zero_stage == 0:  # (FSDP reduces them over edp itself)
            banks = [param for param in now.values() if id(param) in experts]
            edp = ctx.mesh.expert_dim("edp").get_group()
            gradients.model_reducers.append(GradientAllReduce(banks, edp, divisor=ctx.mesh.grad_size))
        if isinstance(done.model, PipelineModel):
            loss_fn = objects.loss_fn
            if loss_fn is None and done.structure is not None and done.structure.causal_lm:
                loss_fn = CausalLMLoss()  # HF batches with labels: the token-mean next-token loss
            elif loss_fn is None and done.structure is not None and done.structure.classifier is not None:
                loss_fn = _objective_only  # (a reward model's objective brings its own loss to the last stage)
            if isinstance(loss_fn, CausalLMLoss):
                loss_fn.fused, objects.fused_head = objects.fused_head, None  # (the schedule runs the forward)
            from meshkit.parallel.pipeline.schedule import PipelineRunner  # (torch's pipelining: a second to import)

            objects.pipeline = PipelineRunner(done.model, ctx.mesh, ctx.config.pipeline, loss_fn)
            balancing, group = objects.balancing
            if balancing is not None and done.structure is not None:  # (each stage adds its MoE layers' terms)
                runner, chunks = objects.pipeline, [unwrap(chunk) for chunk in done.model.chunks]
                stages = PipelineBalancing(balancing, chunks, done.structure.moe, runner.microbatches)
                runner.add_balancing(stages, group)
            if done.structure is not None and done.structure.tied:
                tied = TiedAcrossStages(done.model, done.structure, ctx.mesh)
                gradients.model_reducers.append(tied)
                gradients.counted_elsewhere |= tied.counted_elsewhere
        if ctx.mesh.size("tp") > 1:  # (runs after every reducer above: checks what they left, once)
            gradients.model_reducers.append(WholeGradientsAgree(list(now.items()), ctx.mesh.group("tp")))
        return done.model

    def _own_loss_kept(self, done: Parallelized) -> tuple[bool, int]:
        """(the engine computes the causal-LM loss from the logits, the labels' shift) for a model whose own loss
        `models/own_loss.py` measured: a shift of 1 or 0 is followed; a loss that is neither stays the model's
        own where the model sees whole sequences and whole logits, and is refused where meshkit must compute it."""
        own, mesh = done.own_loss, self.ctx.mesh
        assert own is not None and done.structure is not None
        if own.shift is not None:
            return True, own.shift
        splits = [name for name, on in (("pipeline parallel", isinstance(done.model, PipelineModel)),
                                        ("context parallel", mesh.size("cp") > 1),
                                        ("vocab-sharded logits", done.logits_sharded)) if on]  # fmt: skip
        family = done.structure.family or "the model"
        if splits:
            raise EngineError(
                f"{family}'s own loss is not the next-token cross-entropy of its logits ({own.own:.4f} against "
                f"{own.next_token:.4f} on sample tokens) and {splits[0]} needs meshkit to compute it from the logits: "
                "pass loss_fn= to engine.prepare()"
            )
        print_once_per_node(
            self.ctx.info,
            f"meshkit: {family}'s own loss is not the next-token cross-entropy of its logits: each rank trains on "
            "the model's own loss of its batch",
        )
        return False, 1

    def _embedding_noise(self, done: Parallelized) -> None:
        """NEFTune's noise on the input embeddings (`neftune_noise_alpha`), scaled by the whole sequence's length."""
        alpha, mesh = self.ctx.config.neftune_noise_alpha, self.ctx.mesh
        if alpha is None:
            return
        parts = mesh.size("cp")
        chunks = done.model.chunks if isinstance(done.model, PipelineModel) else [done.model]
        embeddings = [found for chunk in chunks if (found := input_embedding(unwrap(chunk))) is not None]
        if not embeddings and (not isinstance(done.model, PipelineModel) or done.model.has_first_stage):
            raise EngineError("neftune_noise_alpha: the model has no input embedding to add noise to: remove the key")
        for embedding in embeddings:
            add_embedding_noise(embedding, alpha, parts)

    def _fused_head(self, done: Parallelized) -> FusedHead | None:
        """The head that computes train_step's causal-LM loss from its input and weight (`fused_loss`): where
        meshkit computes the loss and the model's logits are its head's output as it is. What was decided goes
        into `objects.loss_path` (the run's record); `auto` says in one line why the loss stays plain."""
        objects, config = self.ctx.objects, self.ctx.config
        setting = config.fused_loss
        if objects.loss_fn is not None:
            name = getattr(objects.loss_fn, "__name__", type(objects.loss_fn).__name__)
            given = f"loss_fn={name} given to prepare()"
            lm = done.structure is not None and done.structure.causal_lm
            objects.loss_path = f"plain (whole logits): {given} reads the logits" if lm else given
            return None
        if not objects.causal_lm:
            own = done.structure is not None and done.structure.causal_lm
            classifier = done.structure.classifier if done.structure is not None else None
            scores = f"from the scores of its classification head {classifier} (no vocabulary to chunk)"
            objects.loss_path = "the model's own loss" if own else scores if classifier else None
            if classifier and setting == "on":
                raise EngineError(f"fused_loss=on, but the loss is {objects.loss_path}: set fused_loss=auto (or off)")
            return None
        found = done.logits_head
        reasons = {
            "fused_loss: off": setting == "off",
            f"strategy={config.strategy} runs the model its own way": config.strategy != "auto",
            (found.why_not if found is not None and found.why_not else "the model's head could not be found"): (
                found is None or found.name is None
            ),
        }
        reason = next((text for text, applies in reasons.items() if applies), None)
        if reason is not None:
            objects.loss_path = f"plain (whole logits): {reason}"
            if setting == "on":
                raise EngineError(f"fused_loss=on, but {reason}: set fused_loss=auto (or off)")
            if setting == "auto":
                print_once_per_node(
                    self.ctx.info, f"meshkit: fused_loss: the loss is computed from the whole logits: {reason}"
                )
            return None
        assert found is not None and found.name is not None
        if not isinstance(done.model, PipelineModel):
            fused: FusedHead | None = FusedHead(unwrap(done.model).get_submodule(found.name))
        else:
            last = done.model.stages - 1  # (the last stage holds the head; the pipeline's loss takes it)
            chunks = [c for c, stage in zip(done.model.chunks, done.model.stage_list, strict=True) if stage == last]
            fused = FusedHead(unwrap(chunks[0]).get_submodule(found.name)) if chunks else None
        objects.loss_path = "fused" + (f" ({fused.describe()})" if fused is not None else " (on the last stage)")
        return fused

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """`model` laid out like the prepared model (split under tp, sharded under ZeRO-3, weights streamed from
        `sharding.init_from` when on the meta device) for forward passes only: frozen, in eval mode, outside
        the optimizer and the gradient reducers (a reference model)."""
        ctx = self.ctx
        model = bare_module(model, ctx.config.strategy).requires_grad_(False)
        done = parallelize(model, ctx.mesh, ctx.config, ctx.placement.zero_stage, frozen=True)
        if isinstance(done.model, PipelineModel):
            raise EngineError("a frozen model under pipeline parallel is not supported yet: set pp=1")
        found = done.logits_head
        if ctx.config.fused_loss != "off" and found is not None and found.name is not None:  # (log-probs in chunks)
            ctx.objects.frozen_heads[done.model] = FusedHead(unwrap(done.model).get_submodule(found.name))
        return done.model.eval()

    def _optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        ctx, gradients = self.ctx, self._gradients()
        optimizer = rebind_params(optimizer, ctx.objects.renamed_params)
        own = ctx.placement.prepare_optimizer(optimizer, ctx.objects.models, ctx.gradient_state)
        if own is not None:  # (the parameter server: the servers update the weights)
            return own
        elsewhere = gradients.reduced_by_models()  # ZeRO leaves these gradients to their reducers
        objects = ctx.objects
        sharded = shard_optimizer(
            optimizer, objects.models, ctx.mesh, ctx.config, ctx.placement.zero_stage, elsewhere, objects.expert_params
        )
        return PreparedOptimizer(sharded, ctx.gradient_state, ctx.scaler, self._after_step)


def _objective_only(output: Any, target: torch.Tensor) -> torch.Tensor:
    raise EngineError(
        "a classification model under pipeline parallel trains through engine.objective_step(batch, objective), "
        "or pass loss_fn= to prepare()"
    )


def scoring_head(model: nn.Module, config: RunConfig) -> FusedHead | None:
    """The head of a model scored beside a fused policy but never prepared (a user's own frozen reference):
    its per-token log-probs are computed as the policy's are, so that equal weights give equal scores."""
    bare = unwrap(model)
    found = logits_head(bare, describe(bare, config.blocks, config.structure))
    return FusedHead(bare.get_submodule(found.name)) if found.name is not None else None
