"""Probes of the model's own work, for the step-time model of `layout: auto`: how fast this machine runs one
block of the model forward and backward with everything around its matmuls (norms, rotary, activations,
attention, dispatch), and what splitting that block over t tensor-parallel ranks adds beyond its 1/t share
and the modelled all-reduces (host dispatch of the split tensors and waiting for the peers, which on ranks
that share cores is most of it). Every rank runs every probe at the same time, as in training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from meshkit.config.layout import Layout, divisors
from meshkit.config.schema import RunConfig, TensorParallelConfig
from meshkit.models.gpt import GPT, GPTConfig
from meshkit.models.structure import describe
from meshkit.parallel.tensor.apply import apply_tensor_parallel
from meshkit.planning.estimate import ModelShape
from meshkit.planning.hardware import Hardware
from meshkit.planning.perf_model import Topology, flops_per_token, tp_layer_comm
from meshkit.planning.probe import timed

CALLS = 6


def _one_block(model: GPTConfig) -> GPTConfig:
    return model.model_copy(update={"n_layers": 1})


def _step(
    model: torch.nn.Module, vocab: int, micro_batch: int, seq_len: int, device: torch.device, sharded: bool = False
) -> Callable[[], None]:
    tokens = torch.randint(0, vocab, (micro_batch, seq_len), device=device)

    def step() -> None:
        with loss_parallel() if sharded else contextlib.nullcontext():
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

    return step


def block_seconds(model: GPTConfig, micro_batch: int, seq_len: int, device: torch.device) -> float:
    """Seconds of one forward + backward of a one-block model at `micro_batch` × `seq_len` (slowest rank)."""
    one = GPT(_one_block(model)).to(device)
    return timed(_step(one, model.vocab_size, micro_batch, seq_len, device), device, calls=CALLS)


def tensor_parallel_block_seconds(
    model: GPTConfig, micro_batch: int, seq_len: int, device: torch.device, tp: int, config: TensorParallelConfig
) -> float:
    """Seconds of one forward + backward of a one-block model split over groups of `tp` neighbouring ranks
    (every rank of the world in some group; collective)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("rest", "tp"))
    one = GPT(_one_block(model)).to(device)
    split = apply_tensor_parallel(one, mesh["tp"], config, describe(one, None, None))
    step = _step(one, model.vocab_size, micro_batch, seq_len, device, split.logits_sharded)
    return timed(step, device, calls=CALLS)


def model_profile(
    hardware: Hardware, config: RunConfig, device: torch.device, world: int, local_world: int
) -> Hardware:
    """`hardware` (measured matmul rate, links) with what the model's own block reaches on it, and what tensor
    parallel adds per block at every degree that fits in a node and divides the heads (collective)."""
    model, micro, seq = config.model, config.train.largest_micro_batch, config.train.seq_len
    plain = block_seconds(model, micro, seq, device)
    shape = ModelShape.from_gpt(_one_block(model))
    flops = sum(flops_per_token(shape, seq)) * micro * seq
    efficiency = min(1.0, flops / plain / (hardware.peak_tflops * 1e12))
    topology = Topology(local_world, max(1, world // local_world))
    precision = "fp32" if config.precision == "no" else config.precision
    overhead: dict[int, float] = {}
    for tp in divisors(local_world):
        if tp == 1 or model.n_heads % tp or model.kv_heads % tp or world % tp:
            continue
        split = tensor_parallel_block_seconds(model, micro, seq, device, tp, config.tensor_parallel)
        layout = Layout(dp_replicate=world // tp, tp=tp)
        modelled = tp_layer_comm(hardware, topology, layout, seq_len=seq, micro_batch=micro, hidden=model.dim,
                                 precision=precision)  # fmt: skip
        overhead[tp] = max(0.0, split - plain / tp - modelled)
    return replace(hardware, matmul_efficiency=efficiency, tp_overhead_s=overhead)
