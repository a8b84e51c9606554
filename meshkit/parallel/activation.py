"""Activation memory: checkpointing (full, selective, every k-th block) and offload of saved activations.

Each repeated block keeps its parameter names: its `forward` is replaced on the instance by a wrapper, so
state dicts, checkpoints and FSDP/DDP wrapping see the same module tree. Applied after tensor and context
parallel (the block's forward is then already split) and before compile and FSDP/DDP (FSDP gathers the
parameters around the wrapped forward, and again before the recomputation in backward).

- full: only the block's inputs stay from forward to backward; backward runs the block's forward again.
- selective: matmul outputs (linear layers) stay; everything else (norms, activation functions, rotary
  embedding, attention) is recomputed from them — the memory-heavy, cheap ops (torch's selective checkpoint
  API, `create_selective_checkpoint_contexts`).
- offload: saved tensors go to (pinned, on an accelerator host) CPU memory during forward and come back in
  backward (`torch.autograd.graph.save_on_cpu`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from meshkit.config.schema import ActivationCheckpointConfig
from meshkit.core.errors import MeshkitError
from meshkit.models.blocks import block_name, block_units, find_blocks


class ActivationError(MeshkitError):
    """Activation checkpointing that cannot be applied; the message says what to change."""


class ActivationOffloadNotice(UserWarning):
    """activation_offload on a host whose activations already live in CPU memory."""


SELECTIVE_API_SINCE = "2.4"


def _saved_ops() -> frozenset[Any]:
    """Ops whose outputs selective checkpointing keeps: the linear layers' matmuls and fused attention.

    Fused attention kernels keep only a per-row log-sum-exp besides their output (no [s, s] scores), so
    keeping their output costs one hidden-sized tensor and saves recomputing the O(s^2) work. Batched
    matmuls (`bmm`) and softmax stay recomputed: in unfused attention they produce the [s, s] scores, which
    are exactly what selective recomputation is meant not to keep.
    """
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


class ActivationMeter(Protocol):
    """What the activation report supplies to count bytes inside checkpointed regions."""

    def observe(self, tensor: torch.Tensor, block: str) -> None: ...

    def recompute_hooks(self, block: str) -> contextlib.AbstractContextManager[None]: ...


def selective_api() -> tuple[Callable[..., Any], Any]:
    """torch's selective checkpoint API, or an error naming the torch version that has it."""
    create = getattr(torch_checkpoint, "create_selective_checkpoint_contexts", None)
    policy = getattr(torch_checkpoint, "CheckpointPolicy", None)
    if create is None or policy is None:
        raise ActivationError(
            f"activation_checkpointing.mode=selective needs torch >= {SELECTIVE_API_SINCE} "
            f"(create_selective_checkpoint_contexts), this is torch {torch.__version__}: upgrade torch, "
            "or use mode=full"
        )
    return create, policy


class CheckpointedBlock:
    """The forward of one block, checkpointed and/or with its saved tensors offloaded.

    `meter` is set by the activation report while it measures a step (None otherwise).
    """

    def __init__(self, block: nn.Module, name: str, mode: str, offload: bool, pin_memory: bool) -> None:
        self.name = name
        self.mode = mode  # none | full | selective
        self.offload = offload
        self.pin_memory = pin_memory
        self.meter: ActivationMeter | None = None
        self._forward = block.forward  # the class's forward, bound to the block
        self._saved_ops = _saved_ops()
        if mode == "selective":
            self._create_contexts, self._policy = selective_api()
            # A partial over a plain function: the form torch.compile can trace as a checkpoint context.
            self._selective_contexts = functools.partial(self._create_contexts, self._selective_policy(None))
        block.forward = self.forward  # instance attribute: names unchanged

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._offload_hooks():
            if self.mode == "none" or not torch.is_grad_enabled():
                return self._forward(*args, **kwargs)
            measured = self.meter is not None and not torch.compiler.is_compiling()
            # torch.compile accepts only selective checkpointing's dispatch modes as contexts: full checkpointing
            # passes none unless a report measures the recomputation (eager only).
            contexts: dict[str, Any]
            if measured:
                contexts = {"context_fn": self._measured_contexts}
            elif self.mode == "selective":
                contexts = {"context_fn": self._selective_contexts}
            else:
                contexts = {}
            return torch_checkpoint.checkpoint(self._forward, *args, use_reentrant=False, **contexts, **kwargs)

    def _offload_hooks(self) -> contextlib.AbstractContextManager[Any]:
        if not self.offload:
            return contextlib.nullcontext()
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory)
        meter = self.meter
        if meter is not None:  # count what goes to CPU: these tensors never reach the report's outer hook
            offload_pack = hooks.pack_hook

            def pack(tensor: torch.Tensor) -> Any:
                meter.observe(tensor, self.name)
                return offload_pack(tensor)

            hooks.pack_hook = pack
        return hooks

    def _measured_contexts(self) -> tuple[Any, Any]:
        """(forward, recomputation) contexts that also count what is kept and recomputed (eager mode)."""
        meter = self.meter
        assert meter is not None
        if self.mode == "selective":
            forward, recompute = self._create_contexts(self._selective_policy(meter))
        else:
            forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        return forward, _both(recompute, meter.recompute_hooks(self.name))

    def _selective_policy(self, meter: ActivationMeter | None) -> Callable[..., Any]:
        saved_ops, policy = self._saved_ops, self._policy

        def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            if op in saved_ops:
                output = getattr(ctx, "op_output", None)  # torch >= 2.6 passes the output: count it
                if meter is not None:
                    for tensor in output if isinstance(output, (tuple, list)) else (output,):
                        if isinstance(tensor, torch.Tensor):
                            meter.observe(tensor, self.name)
                return policy.MUST_SAVE
            return policy.PREFER_RECOMPUTE

        return decide


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    """Enter two context managers as one (checkpointing takes a single recomputation context)."""
    with first, second:
        yield


def apply_activation_checkpointing(
    model: nn.Module,
    cfg: ActivationCheckpointConfig,
    offload: bool,
    device: torch.device,
    blocks_path: str | None = None,
) -> list[CheckpointedBlock]:
    """Wrap the forward of the model's repeated blocks; returns the wrappers (empty when nothing applies).

    With `every: k`, blocks 0, k, 2k, ... are checkpointed; offload applies to every block.
    """
    if cfg.mode == "none" and not offload:
        return []
    if cfg.mode == "selective":
        selective_api()  # fail before touching the model
    try:
        path, blocks = find_blocks(model, blocks_path)
    except MeshkitError as err:
        raise ActivationError(
            f"activation checkpointing/offload acts on repeated blocks: {err} (config key `blocks`)"
        ) from None
    if offload and device.type == "cpu":
        warnings.warn(
            "activation_offload: on a CPU-only host saved activations already live in CPU memory; the run "
            "goes on and pays only the copies (on a GPU this frees the activations' device memory)",
            ActivationOffloadNotice,
            stacklevel=3,
        )
    wrapped = []
    for index, block in block_units(blocks):  # placeholders and parameter-free children are left alone
        mode = cfg.mode if index % cfg.every == 0 else "none"
        if mode == "none" and not offload:
            continue
        wrapped.append(
            CheckpointedBlock(block, block_name(path, index), mode, offload, pin_memory=device.type != "cpu")
        )
    return wrapped
