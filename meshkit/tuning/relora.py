"""ReLoRA (Axolotl's `relora: true` with `jagged_restart_steps`): every `jagged_restart_steps` steps the LoRA
adapters are merged into the base weights, started afresh (A random as peft starts it, B zero), and the Adam
moments of the adapters are mostly zeroed (`relora_prune_method`: the smallest `relora_prune_ratio` of each,
a random share, or nearly all); the learning rate restarts from a floor (`schedules.jagged_restarts`). A sum of
low-rank updates makes a high-rank one.

In every layout the adapters' matrices and moments are taken whole (gathered where ZeRO-3 or tp shards them),
merged, drawn and pruned the same on every rank (seeded by the run's seed, the restart and the layer), and each rank
keeps its own piece — so any world equals one process. A 4- or 8-bit base is merged by peft (dequantized, the
update added, quantized again), in layouts that keep such a weight whole (zero_stage 0, pp). The base that results
lives in the checkpoints (a resumed run goes on from it: a requantized 4-bit weight's quantization state loads back
with it) and in the merged export; an adapter alone would mean nothing without it, so none is written.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshkit.checkpoint.optimizer_states import from_canonical, to_canonical
from meshkit.core.errors import MeshkitError
from meshkit.engine.engine import Engine
from meshkit.models.quantized import quantized_kind
from meshkit.parallel.compose import unwrap
from meshkit.training.schedules import JaggedRestartSettings

PruneMethod = Literal["magnitude", "random", "reset"]
FULL_RESET_RATIO = 0.999  # 'reset': nearly every optimizer state value zeroed (ReLoRA's paper)


class ReloraSettings(JaggedRestartSettings):
    """ReLoRA's keys (Axolotl's names); its restarts are the jagged learning-rate restarts'."""

    relora: bool = Field(False, description="ReLoRA: adapters merged into the base and restarted every restart step")
    relora_prune_ratio: float | None = Field(
        None, ge=0, le=1, description="share of the adapters' optimizer state zeroed at a restart (0.9; reset 0.999)"
    )
    relora_prune_method: PruneMethod | None = Field(
        None, description="magnitude (the smallest zeroed; default) | random | reset"
    )

    @model_validator(mode="after")
    def _relora_has_restart_steps(self) -> ReloraSettings:
        """ReLoRA restarts at `jagged_restart_steps`, so it needs them."""
        if self.relora and not self.jagged_restart_steps:
            raise ValueError("relora: true merges and restarts the adapters every jagged_restart_steps: set it")
        return self

    @property
    def prune_ratio(self) -> float:
        """The share of the adapters' optimizer state a ReLoRA restart zeroes (Axolotl's defaults)."""
        if self.relora_prune_ratio is not None:
            return self.relora_prune_ratio
        return FULL_RESET_RATIO if self.relora_prune_method == "reset" else 0.9


MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's, in checkpoint form (bitsandbytes' and torchao's low-bit ones too)


class ReLoRAError(MeshkitError):
    """A model or optimizer ReLoRA cannot restart; the message says what to change."""


def refusal(adapter: str | None, zero_stage: int, tp: int, quantized: bool, dora: bool) -> str | None:
    """Why ReLoRA cannot run in this layout (one line), or None."""
    if adapter not in ("lora", "qlora"):
        return "relora: true merges and restarts LoRA adapters: set adapter: lora (or qlora)"
    if zero_stage in (1, 2):
        return (
            f"relora: true prunes each adapter's optimizer state, which zero_stage {zero_stage} keeps in flat chunks "
            "of many parameters: use zero_stage 0 or 3"
        )
    if quantized and (zero_stage == 3 or tp > 1):
        return "relora over a 4/8-bit base merges into whole quantized weights: use zero_stage 0 and tp=1 (pp runs)"
    if dora:
        return "relora with DoRA is not supported (a restart would have to rescale the magnitudes): drop one"
    return None


class AdapterRestarts:
    """The restarts; `before_step` is the loop's hook (a restart begins step k × every, also after a resume)."""

    def __init__(self, engine: Engine, every: int, method: PruneMethod, ratio: float) -> None:
        self.engine, self.every, self.method, self.ratio = engine, every, method, ratio
        self.restarts = 0

    def before_step(self, step: int) -> None:
        if step == 0 or step % self.every:
            return
        self.restarts = step // self.every
        layers = _lora_layers(self.engine)
        for name, layer in layers:
            adapter = _only_adapter(name, layer)
            with torch.no_grad():
                _merge(layer, adapter)
                self._start_afresh(layer, adapter, zlib.crc32(name.encode()))  # (by name: a stage holds some)
        self.engine.print(
            f"meshkit: ReLoRA restart {self.restarts} at step {step}: {len(layers)} adapters merged into the base "
            f"and started afresh, their Adam moments pruned ({self.method}, {self.ratio:.1%})"
        )

    def _generator(self, layer_key: int, salt: int) -> torch.Generator:
        seed = self.engine.config.seed
        return torch.Generator().manual_seed(((seed * 1_000_003 + self.restarts) * 7_919 + layer_key) * 4 + salt)

    def _start_afresh(self, layer: Any, adapter: str, index: int) -> None:
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        fresh = torch.empty(a.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=self._generator(index, 0))  # (peft's start)
        _assign(a, fresh)
        _assign(b, torch.zeros(b.shape))
        for salt, param in enumerate((a, b), start=1):
            self._prune(param, self._generator(index, salt))

    def _prune(self, param: nn.Parameter, generator: torch.Generator) -> None:
        owner, states = _states_of(self.engine, param)
        canonical = to_canonical(states)
        moments = [key for key in MOMENTS if isinstance(canonical.get(key), torch.Tensor)]
        if not moments:
            raise ReLoRAError(
                f"ReLoRA prunes Adam's moments (exp_avg, exp_avg_sq); {type(owner).__name__} keeps "
                f"{sorted(states)}: choose an AdamW optimizer"
            )
        for key in moments:
            whole = _whole(canonical[key]).float()
            if self.method == "magnitude":
                threshold = torch.quantile(whole.abs().flatten(), self.ratio)
                kept = whole.abs() > threshold
            else:  # random, reset: a random share kept, the same on every rank
                kept = torch.rand(whole.shape, generator=generator) > self.ratio
            canonical[key] = whole * kept
        if _full_precision_moments(states):
            for key in moments:
                _assign(states[key], canonical[key])
        else:  # low-bit moments: quantized again from the pruned values
            states.update(from_canonical(owner, param, canonical))


def _full_precision_moments(states: dict[str, Any]) -> bool:
    """The optimizer keeps Adam's moments as plain float tensors (not bitsandbytes' or torchao's low-bit ones)."""
    if "state1" in states:
        return False
    moments = [states[key] for key in MOMENTS if isinstance(states.get(key), torch.Tensor)]
    return all(m.dtype.is_floating_point and type(m).__module__.split(".")[0] != "torchao" for m in moments)


def _lora_layers(engine: Engine) -> list[tuple[str, Any]]:
    """(name, layer) of every LoRA layer this rank holds, named as in the whole model — by their parameters'
    names, which a pipeline stage keeps (its modules sit under the stage's own wrappers)."""
    from peft.tuners.lora import LoraLayer

    found = []
    for model in engine.ctx.objects.models:
        names = {id(param): name for name, param in unwrap(model).named_parameters()}
        for module in unwrap(model).modules():
            if isinstance(module, LoraLayer) and module.lora_A:
                first = next(iter(module.lora_A.values())).weight
                found.append((names[id(first)].rsplit(".lora_A.", 1)[0], module))
    return found


def _only_adapter(name: str, layer: Any) -> str:
    adapters = list(layer.lora_A)
    if len(adapters) != 1 or layer.lora_embedding_A or not isinstance(layer.lora_A[adapters[0]], nn.Linear):
        raise ReLoRAError(
            f"ReLoRA merges one linear LoRA adapter per layer; {name} holds "
            f"{'embedding adapters' if layer.lora_embedding_A else f'{len(adapters)} adapters'}: target linear "
            "layers (lora_target_modules / lora_target_linear)"
        )
    return adapters[0]


def _merge(layer: Any, adapter: str) -> None:
    """The adapter's update added into the base weight (each rank its piece)."""
    base = layer.get_base_layer()
    if quantized_kind(base) is not None:  # peft dequantizes, adds and quantizes again
        layer.merge(adapter_names=[adapter])
        layer.merged_adapters.clear()  # (the fresh adapter below is not merged)
        return
    a, b = _whole(layer.lora_A[adapter].weight).float(), _whole(layer.lora_B[adapter].weight).float()
    update = (b @ a) * layer.scaling[adapter]
    if getattr(layer, "fan_in_fan_out", False):  # (GPT-2's Conv1D stores the weight transposed)
        update = update.T
    _assign(base.weight, update, add=True)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _assign(target: torch.Tensor, whole: torch.Tensor, add: bool = False) -> None:
    """`target` (a plain tensor, or this rank's piece of a DTensor) set to `whole`'s values, or `whole` added."""
    if isinstance(target, DTensor):
        value = distribute_tensor(whole.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target, whole = target.to_local(), value.to_local()
    if add:
        target.add_(whole.to(target.dtype))
    else:
        target.copy_(whole.to(target.dtype))


def _states_of(engine: Engine, param: nn.Parameter) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """(the optimizer that keeps `param`'s state, that state), under the engine's wrappers."""
    for prepared in engine.ctx.objects.optimizers:
        owner: Any = prepared
        while owner is not None:
            state = getattr(owner, "state", None)
            if isinstance(state, dict) and param in state:
                return owner, state[param]
            owner = getattr(owner, "optimizer", None)
    raise ReLoRAError(
        "ReLoRA found no optimizer state of an adapter to prune in this layout and optimizer: use adamw_torch"
    )
