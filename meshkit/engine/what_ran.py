"""What ran, read back from the prepared objects rather than from the config: the loss path (fused or plain, and
why), compile's graphs and breaks, the attention computation, tiled MLPs, recomputation per block, NEFTune, the
host allocator the process runs on, and this rank's share of the model's parameters. The banner shows it in one
line, the summary table row by row, summary.json under `ran`; tests and benches read it there."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshkit.engine.ran_optimizer import offload_words, optimizer_words, quantized_words
from meshkit.engine.where_it_runs import attention_words
from meshkit.parallel.applied import held_elements
from meshkit.parallel.compile import dynamo_counts

if TYPE_CHECKING:
    from meshkit.engine.engine import Engine
    from meshkit.engine.prepared_objects import PreparedObjects
    from meshkit.parallel.activation import CheckpointedBlock


def what_ran(
    engine: Engine, every_rank: Callable[[Any], list[Any]] | None = None, stepped: bool = True
) -> dict[str, Any]:
    """The run's record of what is in effect. `every_rank` gathers a value from every rank in rank order (a
    collective: every rank calls this then); without it, the parameter shares are this rank's alone. `stepped`:
    steps have run, so compile's graphs and breaks are counted (before the first step: how it was applied)."""
    objects, config = engine.ctx.objects, engine.config
    held = parameters_held(objects)
    record: dict[str, Any] = {
        "loss": objects.loss_path or "the model's own",
        "compile": compile_words(objects.compiled, objects.compile_counts if stepped else None),
        "attention": attention_words(engine),
        "tiled_mlp": objects.tiled_mlp or "off",
        "recomputation": recomputation_words(objects.checkpointed),
        "neftune": f"noise alpha {config.neftune_noise_alpha:g}" if config.neftune_noise_alpha is not None else "off",
        "allocator": allocator_in_use(),
    }
    if objects.optimizers:
        record["optimizer"] = optimizer_words(objects.optimizers[0], stepped)
    if objects.models:
        optimizer = objects.optimizers[0] if objects.optimizers else None
        record["offload"] = offload_words(objects.models[-1], optimizer, config.sharding.offload)
        quantized = quantized_words(objects.models[-1])
        if quantized is not None:
            record["quantized_base"] = quantized
    seen = objects.sequence_seen.words() if objects.sequence_seen is not None else None
    if seen is not None:
        record["sequence"] = seen
    record |= objects.ran_notes
    shares = every_rank(held) if every_rank is not None else [held]
    record["parameters"] = shares
    return record


def note_ran(engine: Engine, key: str, words: str) -> None:
    """A recipe's own entry in the record (e.g. `liger`: which kernels were applied, or why none)."""
    engine.ctx.objects.ran_notes[key] = words


def one_line(record: dict[str, Any]) -> str:
    """`loss fused (...), compile off, recomputation none, allocator tcmalloc` for a banner."""
    keys = ("loss", "compile", "recomputation", "tiled_mlp", "neftune", "liger", "optimizer", "offload", "allocator")
    shown = [key for key in keys if key in record and not (key == "offload" and record[key] == "none")]
    return ", ".join(f"{key.replace('_', ' ')} {record[key]}" for key in shown)


def parameters_held(objects: PreparedObjects) -> dict[str, Any]:
    """Elements of the model's parameters this rank stores, against the whole model's (`whole`), and the same for
    the parameters split over tensor parallel (`tp_split`: elements of the split layers, `tp_held`: this rank's)."""
    counts = held_elements(objects.models, "tp")
    held, whole = counts["held"], objects.whole_parameters or counts["held"]
    row: dict[str, Any] = {"held": held, "whole": whole, "share": round(held / whole, 4) if whole else 1.0}
    if counts["split"]:
        row |= {"tp_split": counts["split"], "tp_held": counts["split_held"]}
    return row


def compile_words(compiled: str, counts: tuple[int, int] | None) -> str:
    """`off`, or `whole model: 1 graph, 0 graph breaks` (dynamo's counts since the model was prepared)."""
    if compiled == "off" or counts is None:
        return compiled
    graphs, breaks = dynamo_counts()
    graphs, breaks = graphs - counts[0], breaks - counts[1]
    return f"{compiled}: {graphs} graph{'s' * (graphs != 1)}, {breaks} graph break{'s' * (breaks != 1)}"


def recomputation_words(blocks: list[CheckpointedBlock]) -> str:
    """`none`, or `full on 4 blocks, selective on 4` (and `, activations offloaded`)."""
    modes = Counter(block.mode for block in blocks if block.mode != "none")
    if not modes:
        words = "none"
    else:
        words = ", ".join(f"{mode} on {count} block{'s' * (count != 1)}" for mode, count in sorted(modes.items()))
    if any(block.offload for block in blocks):
        words += ", activations offloaded to the host"
    return words


def allocator_in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """The host allocator this process runs on: tcmalloc where loaded, else glibc's malloc (with the fixed mmap
    threshold where the launcher set it)."""
    try:
        loaded = maps.read_text()
    except OSError:
        return "the platform's malloc"
    if "tcmalloc" in loaded:
        return "tcmalloc"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.mmap_threshold" in tunables:
        return "glibc malloc (fixed mmap threshold)"
    return "glibc malloc"
