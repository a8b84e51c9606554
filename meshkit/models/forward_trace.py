"""One traced forward of a model: which of each region's linear layers read the region's input and which write its
output, learnt from the autograd graph rather than from names.

A region is one attention or MLP of a block (a child of the block holding linear layers), or the block itself for
linear layers that are its direct children (OPT's fc1/fc2). During one forward (real weights, or the meta device)
each region's input is replaced by a fresh leaf tensor, and each linear layer's input and output are recorded; then
- a layer **reads** the region when its input leads back to that leaf without passing another linear layer,
- a layer **writes** the region when the region's output leads back to it without passing another of its layers,
- `between` are the operations from the readers' outputs to the writer's input (what the split must survive), and
- `consumers` the first operations applied to each layer's output (how a fused output is cut into its parts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class RegionTrace:
    path: str
    layers: tuple[str, ...]  # the region's own linear layers (for the block itself: its direct children)
    called: list[str] = field(default_factory=list)  # the layers the forward ran
    readers: list[str] = field(default_factory=list)
    writers: list[str] = field(default_factory=list)
    between: set[str] = field(default_factory=set)  # autograd node names from readers' outputs to writers' inputs
    consumers: dict[str, set[str]] = field(default_factory=dict)  # layer -> autograd node names reading its output
    # layer -> G where its output is viewed as [..., G, width / G] and then cut on the last dim (CodeGen's q, v, k
    # in 4 groups, each holding a quarter of the heads): its parts lie one after the other inside each group
    groups: dict[str, int] = field(default_factory=dict)
    # layer -> H where its output is viewed as [batch, seq, H, head_dim] and then cut along H (Ergo's q, k and v
    # heads in one layer, cut by head counts): its parts lie one after the other, in whole heads
    head_cuts: dict[str, int] = field(default_factory=dict)
    # sizes of the dims other than the last that the writers' inputs were cut along (DiffLlama pairs the first half
    # of its heads with the second: a dim as long as the head count, cut in two)
    cut_dims: set[int] = field(default_factory=set)
    sources: dict[str, set[str]] = field(default_factory=dict)  # layer -> the region's layers its input comes from
    output_reads_input: bool = False  # the region's output depends on its input other than through its layers
    # ids of the region's other parameters the writers' inputs depend on (per-head norms): under tp each rank
    # computes only its part of their gradient; the others (a bias the model adds after the region) see whole values
    between_parameters: set[int] = field(default_factory=set)


# autograd operations that act on each feature alone: an MLP whose readers reach its writer through these only
# may be split on its features (activations, gating products, a fused gate/up cut in two, casts, views)
ELEMENTWISE = {
    "MulBackward0",
    "AddBackward0",
    "SubBackward0",
    "DivBackward0",
    "PowBackward0",
    "NegBackward0",
    "SiluBackward0",
    "GeluBackward0",
    "GeLUFunctionBackward",
    "ReluBackward0",
    "SigmoidBackward0",
    "TanhBackward0",
    "EluBackward0",
    "LeakyReluBackward0",
    "HardswishBackward0",
    "HardsigmoidBackward0",
    "SoftplusBackward0",
    "ClampBackward1",
    "ClampMinBackward0",
    "ExpBackward0",
    "ToCopyBackward0",
    "CloneBackward0",
    "SplitBackward0",
    "SplitWithSizesBackward0",
    "UnbindBackward0",
    "NativeDropoutBackward0",
}
# operations that only move features around (a declared MLP split survives them)
RESHAPING = {
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "UnsqueezeBackward0",
    "AccumulateGrad",
}
SPLITS = {"SplitBackward0", "SplitWithSizesBackward0"}
VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"}


@dataclass
class _Record:
    leaf: torch.Tensor | None = None
    output: torch.Tensor | None = None


def walk(start: Any, stop: Callable[[Any], bool]) -> Iterator[Any]:
    """Autograd nodes reachable from `start` (towards the inputs); a node for which `stop` holds is yielded and
    not walked past."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        if not stop(node):
            stack.extend(child for child, _ in node.next_functions)


def first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "last_hidden_state", None)


def trace_regions(
    model: nn.Module, regions: dict[str, tuple[nn.Module, tuple[str, ...]]], run: Callable[[], Any]
) -> dict[str, RegionTrace]:
    """Trace `regions` (path -> (module, its linear layers' names)) through `run()`, one forward of `model`.
    Raises whatever the forward raises; a region the forward never ran is left out of the answer."""
    names = {id(module): name for name, module in model.named_modules()}
    records = {path: _Record() for path in regions}
    produced: dict[Any, str] = {}  # autograd node of a layer's output -> layer name (the node object is kept alive)
    inputs: dict[str, torch.Tensor] = {}
    handles = []

    def leaf_in(path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                records[path].leaf = args[0].detach().requires_grad_()
                return (records[path].leaf, *args[1:]), kwargs
            hidden = kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor) and hidden.is_floating_point():
                records[path].leaf = hidden.detach().requires_grad_()
                return args, {**kwargs, "hidden_states": records[path].leaf}
            return None

        return hook

    def output_of(path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            records[path].output = first_tensor(output)

        return hook

    def layer_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        tensor = first_tensor(output)
        if tensor is not None and tensor.grad_fn is not None:
            produced[tensor.grad_fn] = names[id(module)]

    def layer_input(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            inputs.setdefault(names[id(module)], args[0])

    layer_names = {name for _, layers in regions.values() for name in layers}
    try:
        for path, (module, _) in regions.items():
            handles.append(module.register_forward_pre_hook(leaf_in(path), with_kwargs=True))
            handles.append(module.register_forward_hook(output_of(path)))
        for name, module in model.named_modules():
            if name in layer_names:
                handles.append(module.register_forward_pre_hook(layer_input))
                handles.append(module.register_forward_hook(layer_output))
        with torch.enable_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return {
        path: _read(path, layers, records[path], produced, inputs)
        for path, (_, layers) in regions.items()
        if records[path].leaf is not None and records[path].output is not None
    }


def _read(
    path: str, layers: tuple[str, ...], record: _Record, produced: dict[Any, str], inputs: dict[str, torch.Tensor]
) -> RegionTrace:
    trace = RegionTrace(path, layers)
    own = set(layers)
    is_layer = produced.__contains__
    assert record.output is not None and record.leaf is not None

    def visit(start: Any) -> list[Any]:
        nodes = list(walk(start, is_layer))
        for node in nodes:
            for child, _ in node.next_functions:
                if child in produced and produced[child] in own:
                    trace.consumers.setdefault(produced[child], set()).add(type(node).__name__)
                elif type(node).__name__ in SPLITS and type(child).__name__ in VIEWS:
                    _grouped(node, child)
        return nodes

    def _grouped(split: Any, view: Any) -> None:
        """A split of a view of one of the layers' outputs: on the last dim of [..., G, width / G] (groups), or
        on the heads dim of [batch, seq, H, head_dim] (parts in whole heads)."""
        viewed, dim = tuple(split._saved_self_sym_sizes), _dim(split)
        layer = next((produced[c] for c, _ in view.next_functions if c in produced and produced[c] in own), None)
        if layer is not None and len(viewed) >= 3 and dim in (-1, len(viewed) - 1) and int(viewed[-2]) > 1:
            trace.groups[layer] = int(viewed[-2])
        elif layer is not None and len(viewed) == 4 and dim in (-2, 2) and int(viewed[-2]) > 1:
            trace.head_cuts[layer] = int(viewed[-2])

    if record.output is not record.leaf:
        walked = visit(record.output.grad_fn)
        writers = {produced[node] for node in walked if node in produced}
        trace.writers = [name for name in layers if name in writers]
        trace.output_reads_input = any(
            type(node).__name__ == "AccumulateGrad" and node.variable is record.leaf for node in walked
        )
    for name in layers:
        given = inputs.get(name)
        if given is None:
            continue
        trace.called.append(name)
        walked = visit(given.grad_fn)
        trace.sources[name] = {produced[node] for node in walked if node in produced and produced[node] in own}
        if given is record.leaf or any(
            type(node).__name__ == "AccumulateGrad" and node.variable is record.leaf for node in walked
        ):
            trace.readers.append(name)
        if name in trace.writers:
            trace.between |= {type(node).__name__ for node in walked if node not in produced}
            for node in (node for node in walked if type(node).__name__ in SPLITS):
                sizes, dim = tuple(node._saved_self_sym_sizes), _dim(node)
                if dim % len(sizes) != len(sizes) - 1:
                    trace.cut_dims.add(int(sizes[dim]))
            trace.between_parameters |= {
                id(node.variable) for node in walked if type(node).__name__ == "AccumulateGrad"
            }
    return trace


def _dim(split: Any) -> int:
    """A split node's dim (autograd keeps a negative one as an unsigned 64-bit int)."""
    dim = int(split._saved_dim)
    return dim - 2**64 if dim >= 2**63 else dim
