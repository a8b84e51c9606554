"""What `Engine.prepare()` produced: the prepared models, optimizers, schedulers and loaders, and what each
prepared model needs remembered (fused weights split by tensor parallel, tied names, LoRA layers to fold, the
user's own module), in one record every engine component reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from torch import nn

from meshkit.core.errors import MeshkitError
from meshkit.data.loader import ShardedLoader
from meshkit.models.adapters import LoraMerge
from meshkit.parallel.activation import CheckpointedBlock
from meshkit.parallel.sequence_seen import SequenceSeen
from meshkit.parallel.tensor.storage import SplitWeights
from meshkit.training.accumulation import PreparedOptimizer, PreparedScheduler
from meshkit.training.fused_head import FusedHead
from meshkit.training.loss import LossFn, TokenWeights
from meshkit.training.router_loss import BalancingLoss


class EngineError(MeshkitError):
    """Wrong use of the engine; the message says what to do instead."""


if TYPE_CHECKING:  # (torch's pipelining is imported where a pipeline is prepared: it costs a second)
    from meshkit.parallel.pipeline.schedule import PipelineRunner


@dataclass
class PreparedObjects:
    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[PreparedOptimizer] = field(default_factory=list)
    schedulers: list[PreparedScheduler] = field(default_factory=list)
    loaders: list[ShardedLoader] = field(default_factory=list)
    registered: list[Any] = field(default_factory=list)  # engine.register_for_checkpointing
    checkpointed: list[CheckpointedBlock] = field(default_factory=list)  # blocks under activation checkpointing
    compiled: str = "off"  # how torch.compile was applied to the (last) prepared model that trains
    loss_fn: LossFn | None = None  # prepare(..., loss_fn=) or the Engine's
    pipeline: PipelineRunner | None = None  # the prepared model is split into pipeline stages
    # id(original parameter) -> the one splitting put in its place (None: it lives on another pipeline stage)
    renamed_params: dict[int, nn.Parameter | None] = field(default_factory=dict)
    expert_params: set[int] = field(default_factory=set)  # ids of the expert banks' parameters split over ep
    logits_sharded: bool = False  # a prepared model returns vocab-sharded logits (tensor parallel)
    causal_lm: bool = False  # the prepared model is a causal LM (next-token logits)
    label_shift: int = 1  # its labels' targets: labels[:, shift:] for logits[:, :-shift] (`models/own_loss.py`)
    classifier: str | None = None  # the prepared model's classification head (a reward model's), by module name
    training_inputs: dict[str, Any] = field(default_factory=dict)  # keywords train_step adds to an HF batch
    # the router's balancing loss train_step adds (mixture of experts), and the ranks it takes statistics over
    balancing: tuple[BalancingLoss | None, Any] = (None, None)
    token_weights: TokenWeights | None = None  # each token's loss weight in train_step's causal-LM loss (EAFT)
    fused_head: FusedHead | None = None  # the head computing train_step's causal-LM loss without the logits
    # a frozen model scored beside the policy (a reference) -> its head computing log-probs as the policy's does
    frozen_heads: WeakKeyDictionary[nn.Module, FusedHead | None] = field(default_factory=WeakKeyDictionary)
    loss_path: str | None = None  # how train_step's loss is computed, in words (fused, or plain and why)
    tiled_mlp: str | None = None  # the MLPs tiled over the sequence, or why none (None: not asked)
    compile_counts: tuple[int, int] | None = None  # dynamo's (graphs, graph breaks) when the model was prepared
    whole_parameters: int = 0  # elements of the trained models' parameters before any split
    ran_notes: dict[str, str] = field(default_factory=dict)  # a recipe's own entries in the record of what ran
    start_rss: int = 0  # resident bytes when prepare() was first called (libraries, data; no model tensor yet)
    train_peak_rss: int = 0  # the peak resident bytes when the training loop ended (before exports)
    sequence_seen: SequenceSeen | None = None  # the sequence the first block saw (tp, cp), for the record
    uneven: tuple[int, int] | None = None  # (this rank's samples, all ranks') under per-rank batch sizes
    # id(prepared model) -> ...
    split_weights: dict[int, SplitWeights] = field(default_factory=dict)  # how tensor parallel stores fused weights
    tied_aliases: dict[int, dict[str, str]] = field(default_factory=dict)  # tied name -> stored name
    adapter_merges: dict[int, dict[str, LoraMerge]] = field(default_factory=dict)  # LoRA layers to fold
    user_modules: dict[int, nn.Module] = field(default_factory=dict)  # the module the user passed

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by `load_state`)."""
        return self.optimizers[0].steps_taken if self.optimizers else 0

    def only_model(self, model: nn.Module | None = None) -> nn.Module:
        """`model`, or the one prepared model when none is named."""
        return model if model is not None else self._only("model", self.models)

    def only_optimizer(self) -> PreparedOptimizer:
        return self._only("optimizer", self.optimizers)

    def forget(self) -> None:
        """Drop the references to every prepared object (`free_memory`)."""
        for registry in (self.models, self.optimizers, self.schedulers, self.loaders):
            registry.clear()

    @staticmethod
    def _only(kind: str, registry: list[Any]) -> Any:
        if len(registry) != 1:
            raise EngineError(
                f"this call needs exactly one prepared {kind}, found {len(registry)}: pass the one you mean"
            )
        return registry[0]
