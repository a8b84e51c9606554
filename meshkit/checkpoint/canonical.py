"""The training state in one layout-free form: every tensor under its original name and full shape.

Model weights are saved under `model.<name>` and optimizer states under `optim.<param name>.<state>`, each a
DTensor (sharded by FSDP or tensor parallel), or a plain tensor (replicated): torch.distributed.checkpoint
records each rank's piece with its offsets, and a later load at another layout reads exactly the pieces
it needs. Two exceptions:

- fused weights under tensor parallel are stored in their own order (`parallel/tensor/storage.py`); they are
  saved in the canonical order as full tensors and put back in tensor parallel's order on load;
- ZeRO-1/2 keep each param group's optimizer state as one flat buffer split at arbitrary offsets, which no
  rectangular piece of a parameter can describe. It is saved as `optim.flat.pp<p>.group<g>.<state>`, one
  1-D tensor per group split over the data-parallel ranks, and loads directly at any ZeRO-1/2 world size
  (under expert parallel a group's expert banks have a buffer of their own per ep rank,
  `optim.flat.pp<p>.experts<e>.group<g>.<state>`, split over the ranks holding those experts).
  Moving between this form and the per-parameter one (e.g. ZeRO-1 → DDP) reads the full states on every
  rank once: transient memory of one unsharded optimizer state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshkit.checkpoint.model_match import CheckpointLayoutError, StoredShapes, check_keys, raise_mismatch
from meshkit.checkpoint.optimizer_states import from_canonical, restore_settings, to_canonical
from meshkit.core.io import plain_numbers
from meshkit.models.quantized import is_packed_quant_state, restore_quant_states
from meshkit.parallel.compose import unwrap
from meshkit.parallel.tensor.storage import SplitWeights
from meshkit.parallel.zero.nvme import NVMeOptimizer
from meshkit.parallel.zero.optimizer import FlatShard, ZeroOptimizer
from meshkit.runtime import collectives
from meshkit.runtime.mesh import ParallelMesh
from meshkit.training.accumulation import PreparedOptimizer

Reader = Callable[[dict[str, torch.Tensor]], None]  # fills the given tensors (in place) from the checkpoint


def _prefix(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}{index}"


def _inner(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, PreparedOptimizer) else optimizer


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A full tensor laid out like `param`: this rank's piece of it, without communication."""
    if isinstance(param, DTensor):
        return distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
    return full.to(device=param.device)


@dataclass
class Parameters:
    """One prepared model's parameters by name, and how tensor parallel stores the fused ones."""

    names: dict[int, str]  # id(parameter) -> name
    split_weights: SplitWeights  # under the checkpoint's names

    def to_canonical(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.split_weights.to_canonical(name, _full(tensor)) if name in self.split_weights else tensor

    def from_canonical(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return _like(self.split_weights.to_storage(name, full), like)


class TrainingState:
    """Maps the prepared models and optimizers of an engine to checkpoint tensors and back."""

    def __init__(
        self,
        models: list[nn.Module],
        optimizers: list[Any],
        split_weights: dict[int, SplitWeights],
        mesh: ParallelMesh,
        aliases: dict[int, dict[str, str]] | None = None,
    ) -> None:
        self.models = models
        # Tied weights are stored once, under their group's first name; the other names (and, under a
        # pipeline, the other stage's copy) read it back from there.
        self.aliases = aliases or {}
        self.optimizers = optimizers
        self.mesh = mesh
        tp = mesh.size("tp")
        self.parameters: dict[int, str] = {}
        stored_as = []
        for index, model in enumerate(models):
            prefix = _prefix("model", index)
            for name, param in unwrap(model).named_parameters():
                self.parameters[id(param)] = f"{prefix}.{self._stored_name(model, name)}"
            stored_as.append(split_weights.get(id(model), SplitWeights(tp)).prefixed(prefix))
        self.split_weights = SplitWeights.union(stored_as, tp)
        self.names = Parameters(self.parameters, self.split_weights)

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def exposed(self) -> Iterator[None]:
        """Optimizer states in memory (NVMe offload keeps them in files between steps)."""
        with contextlib.ExitStack() as stack:
            for optimizer in self.optimizers:
                inner = _inner(optimizer)
                paged = inner.inner if isinstance(inner, ZeroOptimizer) else inner
                if isinstance(paged, NVMeOptimizer):
                    stack.enter_context(paged.paged_in())
            yield

    def _stored_name(self, model: nn.Module, name: str) -> str:
        return self.aliases.get(id(model), {}).get(name, name)

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The models' state dicts under their stored names, each tied tensor once."""
        out: dict[str, torch.Tensor] = {}
        for index, model in enumerate(self.models):
            prefix = _prefix("model", index)
            for name, tensor in unwrap(model).state_dict().items():
                out.setdefault(f"{prefix}.{self._stored_name(model, name)}", tensor)
        return out

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        return {key: self.names.to_canonical(key, tensor) for key, tensor in self._model_state().items()}

    def _flat_key(self, index: int, shard: FlatShard, state: str) -> str:
        # Under tensor parallel each tp rank's flat buffer holds its own shards: one key per tp coordinate; under
        # expert parallel each ep rank's expert buffer holds its own experts: one key per ep coordinate.
        tp = f".tp{self.mesh.coordinate('tp')}" if self.mesh.size("tp") > 1 else ""
        ep = f".experts{self.mesh.expert_dim('ep').get_local_rank()}" if shard.expert else ""
        pp = self.mesh.coordinate("pp")
        return f"{_prefix('optim', index)}.flat.pp{pp}{tp}{ep}.group{shard.group_index}.{state}"

    def _refuse_flat_crossing(self, index: int, stored: StoredShapes, into: ZeroOptimizer | None) -> None:
        """ZeRO-1/2 states saved under tensor or expert parallel hold tp shards (and each ep rank's experts) in
        flat buffers: only ZeRO-1/2 at the same tp and ep sizes can read them (any dp size); anything else would
        need them cut out and reassembled."""
        flat = [k.split(".") for k in stored if k.startswith(f"{_prefix('optim', index)}.flat.")]
        saved_tp = len({part for k in flat for part in k[3:4] if part.startswith("tp")}) or 1
        saved_ep = len({part for k in flat for part in k[3:5] if part.startswith("experts")}) or 1
        experts = into is not None and any(shard.expert for shard in into.shards)
        readable = (self.mesh.size("tp"), self.mesh.dims.ep if experts else 1) if into else (1, 1)
        if flat and (saved_tp, saved_ep) != readable:
            here = f"ZeRO-1/2 with tp={readable[0]}, ep={readable[1]}" if into else "not ZeRO-1/2"
            raise CheckpointLayoutError(
                f"optimizer states were saved by ZeRO-1/2 with tp={saved_tp}, ep={saved_ep} (flat buffers of "
                f"this rank's pieces) and this run is {here}: resume with the saving run's zero_stage, tp and ep "
                "(any dp), or export the weights (meshkit export) and start the optimizer afresh"
            )

    # ------------------------------------------------------------------ save
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor to save (call inside `exposed()`)."""
        out = self._model_tensors()
        for index, optimizer in enumerate(self.optimizers):
            inner = _inner(optimizer)
            if isinstance(inner, ZeroOptimizer):
                for shard in inner.shards:
                    for state, value in to_canonical(inner.state.get(shard.shard, {})).items():
                        if isinstance(value, torch.Tensor):
                            out[self._flat_key(index, shard, state)] = self._flat_piece(shard, value)
                continue
            prefix = _prefix("optim", index)
            for param, states in inner.state.items():
                name = self.parameters[id(param)]
                for state, value in to_canonical(states).items():
                    if isinstance(value, torch.Tensor):
                        value = _as_laid_out(value, param)
                        key = f"{prefix}.{name.partition('.')[2]}.{state}"
                        out[key] = self.names.to_canonical(name, value) if value.shape == param.shape else value
        return out

    def _flat_piece(self, shard: FlatShard, value: torch.Tensor) -> torch.Tensor:
        if value.shape != shard.shard.shape:
            return value  # a scalar such as Adam's step: the same on every rank
        numel = sum(size for _, size in shard.slices)
        start = shard.bounds[0]
        valid = max(0, min(shard.chunk, numel - start))
        mesh = self.mesh.expert_dim("edp") if shard.expert else self.mesh.grad_mesh  # the ranks it is chunked over
        return DTensor.from_local(
            value[:valid], mesh, [Shard(0)], run_check=False, shape=torch.Size((numel,)), stride=(1,)
        )

    def hyperparameters(self) -> list[list[dict[str, Any]]]:
        """Per optimizer, its param groups' settings (JSON-ready; parameters left out)."""
        return [
            [plain_numbers({k: v for k, v in group.items() if k != "params"}) for group in _inner(opt).param_groups]
            for opt in self.optimizers
        ]

    # ------------------------------------------------------------------ load
    def load(self, stored: StoredShapes, read: Reader, hyperparameters: list[list[dict[str, Any]]] | None) -> None:
        """Fill the models and optimizers from a checkpoint (call inside `exposed()`)."""
        self._load_model(stored, read)
        for index, optimizer in enumerate(self.optimizers):
            inner = _inner(optimizer)
            if isinstance(inner, ZeroOptimizer):
                self._load_flat(index, inner, stored, read)
            else:
                self._load_per_param(index, inner, stored, read)
            if hyperparameters and index < len(hyperparameters):
                for group, saved in zip(inner.param_groups, hyperparameters[index], strict=False):
                    restore_settings(group, saved)

    def _load_model(self, stored: StoredShapes, read: Reader) -> None:
        live = self._model_state()
        everywhere = set(live)
        if self.mesh.size("pp") > 1:  # each stage holds some layers: the model is the union over stages
            everywhere = set().union(*collectives.gather_object(sorted(live), self.mesh.group("pp")))
        check_keys(live, stored, everywhere, any_length=is_packed_quant_state)
        split = self.split_weights
        fresh = {k for k in live if k in split or is_packed_quant_state(k)}
        targets = {k: torch.empty(stored[k][0], dtype=v.dtype) if k in fresh else v for k, v in live.items()}
        read(targets)  # in place: the state dict's tensors share the parameters' storage
        for key in split.names & set(live):
            with torch.no_grad():
                _local(live[key]).copy_(_local(self.names.from_canonical(key, targets[key], live[key])))
        for index, model in enumerate(self.models):  # 4-bit weights quantized again since they loaded
            head = f"{_prefix('model', index)}."
            own = {key[len(head) :]: tensor for key, tensor in targets.items() if key.startswith(head)}
            if any(is_packed_quant_state(key) for key in own):
                restore_quant_states(unwrap(model), own)

    def _param_state_targets(
        self, prefix: str, name: str, param: torch.Tensor, stored: StoredShapes
    ) -> dict[str, torch.Tensor]:
        targets: dict[str, torch.Tensor] = {}
        for key, (shape, dtype) in stored.items():
            head = f"{prefix}.{name.partition('.')[2]}."
            if not key.startswith(head) or "." in key[len(head) :]:
                continue
            if shape == param.shape and name not in self.split_weights:
                targets[key] = torch.empty_like(param, dtype=dtype)
            else:
                targets[key] = torch.empty(shape, dtype=dtype)
        return targets

    def _load_per_param(self, index: int, inner: Any, stored: StoredShapes, read: Reader) -> None:
        prefix = _prefix("optim", index)
        params = [p for group in inner.param_groups for p in group["params"]]
        flat_stored = any(k.startswith(f"{prefix}.flat.") for k in stored)
        if flat_stored:
            self._refuse_flat_crossing(index, stored, into=None)
            full = self._read_flat_as_full(index, stored, read)
        targets: dict[int, dict[str, torch.Tensor]] = {}
        for param in params:
            name = self.parameters[id(param)]
            if flat_stored:
                targets[id(param)] = {s: t for s, t in full.get(name, {}).items()}
                continue
            targets[id(param)] = self._param_state_targets(prefix, name, param, stored)
        if not flat_stored:
            read({k: t for per in targets.values() for k, t in per.items()})
        for param in params:
            name = self.parameters[id(param)]
            head = len(f"{prefix}.{name.partition('.')[2]}.")
            states = {}
            for key, tensor in targets[id(param)].items():
                state = key if flat_stored else key[head:]
                if tensor.shape == param.shape and not isinstance(tensor, DTensor):
                    tensor = self.names.from_canonical(name, tensor, param)
                states[state] = tensor
            if states:
                inner.state[param] = from_canonical(inner, param, states)

    def _read_flat_as_full(self, index: int, stored: StoredShapes, read: Reader) -> dict[str, dict[str, Any]]:
        """flat ZeRO-1/2 states -> {param name: {state: full tensor}} for this rank's parameters."""
        layout = flat_layout(_inner(self.optimizers[index]).param_groups, self.parameters)
        wanted = {
            key: torch.empty(shape, dtype=dtype)
            for key, (shape, dtype) in stored.items()
            if key.startswith(f"{_prefix('optim', index)}.flat.pp{self.mesh.coordinate('pp')}.")
        }
        read(wanted)
        out: dict[str, dict[str, Any]] = {}
        for key, tensor in wanted.items():
            group, state = int(key.split(".")[3].removeprefix("group")), key.split(".", 4)[4]
            if group >= len(layout):
                raise_mismatch(f"optimizer param group {group}", "missing in this run")
            for name, offset, shape in layout[group]:
                piece = tensor if tensor.dim() == 0 else tensor[offset : offset + shape.numel()].view(shape)
                out.setdefault(name, {})[state] = piece.clone()
        return out

    def _load_flat(self, index: int, inner: ZeroOptimizer, stored: StoredShapes, read: Reader) -> None:
        prefix = _prefix("optim", index)
        if not any(k.startswith(f"{prefix}.flat.") for k in stored):  # saved per parameter: rebuild the chunks
            per_param = {
                self.parameters[id(p)]: self._param_state_targets(prefix, self.parameters[id(p)], p, stored)
                for s in inner.shards
                for p in s.params
            }
            read({k: t for per in per_param.values() for k, t in per.items()})
            for shard in inner.shards:
                states: dict[str, list[torch.Tensor]] = {}
                for param in shard.params:
                    name = self.parameters[id(param)]
                    head = len(f"{prefix}.{name.partition('.')[2]}.")
                    for key, tensor in per_param[name].items():
                        # under tensor parallel the chunks hold this rank's shards, not the full states
                        piece = _local(tensor) if shard.distributed else _full(tensor)
                        states.setdefault(key[head:], []).append(piece)
                chunk_states = {state: _chunk_of(shard, values) for state, values in states.items()}
                inner.state[shard.shard] = from_canonical(inner.inner, shard.shard, chunk_states)
            return
        self._refuse_flat_crossing(index, stored, into=inner)
        targets: dict[str, torch.Tensor] = {}
        for shard in inner.shards:
            state = inner.state.setdefault(shard.shard, {})
            for key, (shape, dtype) in stored.items():
                shard_key = self._flat_key(index, shard, "")
                if not key.startswith(shard_key):
                    continue
                name = key[len(shard_key) :]
                numel = sum(size for _, size in shard.slices)
                if len(shape) == 1 and shape[0] != numel:
                    raise_mismatch(f"{key} of {shape[0]} elements", f"{numel} in this run")
                if len(shape) == 1:
                    state[name] = torch.zeros_like(shard.shard, dtype=dtype)
                    targets[key] = self._flat_piece(shard, state[name])
                else:
                    state[name] = targets[key] = torch.empty(shape, dtype=dtype)
        read(targets)
        for shard in inner.shards:
            inner.state[shard.shard] = from_canonical(inner.inner, shard.shard, inner.state[shard.shard])


def _as_laid_out(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A state of this rank's local piece of a DTensor parameter (an optimizer stepping plain pieces) as a DTensor
    laid out like the parameter; any other value unchanged."""
    if not isinstance(param, DTensor) or isinstance(value, DTensor) or value.shape != param.to_local().shape:
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _chunk_of(shard: FlatShard, values: list[torch.Tensor]) -> torch.Tensor:
    """This rank's chunk of the flat concatenation of per-parameter states (scalars: the first one)."""
    if values[0].shape != shard.params[0].shape and values[0].dim() == 0:
        return values[0].clone()
    flat = torch.cat([v.reshape(-1) for v in values])
    chunk = torch.zeros_like(shard.shard, dtype=flat.dtype)
    start, end = shard.bounds
    piece = flat[start : min(end, flat.numel())]
    chunk[: piece.numel()].copy_(piece)
    return chunk


def flat_layout(param_groups: list[dict[str, Any]], names: dict[int, str]) -> list[list[tuple[str, int, torch.Size]]]:
    """Per param group: (name, offset, shape) of each parameter in the group's flat buffer."""
    layout = []
    for group in param_groups:
        offset, entries = 0, []
        for param in group["params"]:  # ZeRO-1/2 flatten a group's trainable parameters in this same order
            if not param.requires_grad:
                continue
            entries.append((names[id(param)], offset, param.shape))
            offset += param.numel()
        layout.append(entries)
    return layout
