"""Data-parallel loading: every dp rank reads its own part of the data, on its device.

`shard_dataloader` rebuilds a user's DataLoader around a `DistributedSampler` (shuffled when the original
shuffled, seeded from the run seed, reshuffled each epoch) and moves each batch to the device. It also knows
which samples of the last batch are padding (the sampler repeats a few samples so that every rank gets the
same count), so `gather_for_metrics` can return exactly the dataset's samples.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from meshkit.core.errors import MeshkitError
from meshkit.core.tree import to_device
from meshkit.data.resumable import ResumableSampler, dataset_length
from meshkit.data.uneven import UnevenBatchSampler
from meshkit.training.accumulation import GradientState


class DataLoaderError(MeshkitError):
    """A DataLoader meshkit cannot shard; the message says how to pass it."""


class ShardedLoader:
    """Iterates this rank's batches on the device and tracks the position for padding-aware gathers."""

    def __init__(self, loader: DataLoader, device: torch.device, state: GradientState) -> None:
        self.loader = loader
        self.device = device
        self.gradient_state = state
        self.epoch = 0
        self.batch_index = -1  # index of the batch last yielded (kept after the epoch ends, for metrics)
        self._read = 0  # batches of the current epoch read so far (0 once the epoch is over)
        self._epoch_start = 0  # global sample position this epoch's iteration began at (a resumed epoch)
        self._skip_batches = 0  # batches to drop at the next epoch start (resume without a ResumableSampler)
        self._resumed_batches = 0  # batches a stream that restored its own place reads on after (not read again)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        """This rank's batches in a whole epoch, as Accelerate's prepared loader counts them — also after
        `load_state` put the position inside an epoch (the next pass then yields only the rest of it), so a
        script's `resume_step // len(loader)` finds the epoch."""
        sampler = self._position
        batch = self.loader.batch_size
        if isinstance(sampler, ResumableSampler) and batch:
            per_rank = sampler.per_rank(0)
            return per_rank // batch if self.loader.drop_last else -(-per_rank // batch)
        if isinstance(sampler, UnevenBatchSampler):
            return sampler.dataset_len // sampler.global_batch
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at `epoch` (the shuffle order depends on it)."""
        self.epoch = epoch

    @property
    def _position(self) -> Any:
        """The sampler that knows the global position (a ResumableSampler, or the uneven batch sampler)."""
        uneven = self.loader.batch_sampler
        return uneven if isinstance(uneven, UnevenBatchSampler) else self.loader.sampler

    def __iter__(self) -> Iterator[Any]:
        for sampler in (self.loader.sampler, self.loader.batch_sampler, self.loader.dataset):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
        try:
            last = len(self.loader) - 1
        except TypeError:  # an iterable dataset of unknown length
            last = -1
        self.gradient_state.active_loader = self
        sampler = self._position
        self._epoch_start = sampler.start if isinstance(sampler, (ResumableSampler, UnevenBatchSampler)) else 0
        self.batch_index = -1
        skip, self._skip_batches = self._skip_batches, 0
        offset, self._resumed_batches = self._resumed_batches, 0
        self._read = skip + offset
        batches = self._batches(resumed=self._epoch_start > 0 or skip > 0 or offset > 0)
        for index, batch in enumerate(batches, start=offset):
            if index < skip:
                continue
            self.batch_index = index
            self._read = index + 1
            self.gradient_state.end_of_dataloader = index == last
            yield to_device(batch, self.device)
        self.gradient_state.end_of_dataloader = False
        if self.gradient_state.active_loader is self:  # a gather after the loop is not about this loader's padding
            self.gradient_state.active_loader = None
        self._read = 0
        if isinstance(sampler, (ResumableSampler, UnevenBatchSampler)):
            sampler.start = 0
        self.epoch += 1

    def _batches(self, *, resumed: bool) -> Iterator[Any]:
        """The DataLoader's iterator. Starting one draws a number from the process's torch generator (the workers'
        base seed); an uninterrupted run drew it at the epoch's start, before the checkpoint that restored the
        generator, so a resumed epoch's iterator starts without drawing again: a collator that draws (masking,
        noise) then gives the resumed batches what it gave the uninterrupted run's."""
        if not resumed:
            return iter(self.loader)
        with torch.random.fork_rng(devices=[]):
            return iter(self.loader)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Where the data stands: the epoch, and how many of its samples every rank together has read."""
        sampler = self._position
        if isinstance(sampler, UnevenBatchSampler):
            return {"epoch": self.epoch, "samples_seen": sampler.start + self._read * sampler.global_batch}
        batch = self.loader.batch_size or 1
        if isinstance(sampler, ResumableSampler):
            seen = sampler.start + self._read * batch * sampler.num_replicas
            return {"epoch": self.epoch, "samples_seen": seen}
        state: dict[str, Any] = {"epoch": self.epoch, "batches_seen": self._read}
        place = _stream_place(self.loader)
        return {**state, "stream": place} if place is not None else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`; the next iteration yields exactly the batches not read yet. A stream that keeps
        its own place (`state["stream"]`, this rank's) reads on from there; any other is read again from its
        start, the batches already read dropped."""
        self.epoch = int(state["epoch"])
        sampler = self._position
        if "samples_seen" in state and isinstance(sampler, (ResumableSampler, UnevenBatchSampler)):
            sampler.start = int(state["samples_seen"])
            if len(self.loader) == 0:  # saved at the epoch's end: the next pass is the next epoch, whole
                sampler.start, self.epoch = 0, self.epoch + 1
        elif "batches_seen" in state:
            restore = getattr(self.loader.dataset, "load_state_dict", None)
            if state.get("stream") is not None and callable(restore) and restore(state["stream"]) is not False:
                self._resumed_batches = int(state["batches_seen"])
                return
            if state.get("stream") is not None:
                warnings.warn(
                    "the checkpoint's place in the data stream is another rank's share: this rank reads its share "
                    f"from the start again and skips {state['batches_seen']} batches",
                    stacklevel=2,
                )
            self._skip_batches = int(state["batches_seen"])
        else:  # a sampler position saved by a ResumableSampler, resumed on a user's own sampler
            batch = self.loader.batch_size or 1
            replicas = getattr(sampler, "num_replicas", 1)
            self._skip_batches = int(state["samples_seen"]) // (batch * replicas)

    def start_at_batch(self, index: int) -> None:
        """The next iteration begins at this rank's batch `index` of the current epoch (counted from the epoch's
        start, so a position restored by `load_state` for the same batch is not skipped twice)."""
        sampler = self._position
        if isinstance(sampler, UnevenBatchSampler):
            sampler.start = index * sampler.global_batch
        elif isinstance(sampler, ResumableSampler):
            sampler.start = index * (self.loader.batch_size or 1) * sampler.num_replicas
        else:
            self._skip_batches = index

    def place(self) -> tuple[int, int, int]:
        """Where this rank stands: (epoch, batch last yielded, the epoch's starting position)."""
        return (self.epoch, self.batch_index, self._epoch_start)

    def valid_counts(self) -> list[int] | None:
        """Per dp rank, how many samples of the current batch are real (not sampler padding); None if unknown."""
        sampler = self.loader.sampler
        batch = self.loader.batch_size
        if not isinstance(sampler, DistributedSampler) or batch is None or self.batch_index < 0:
            return None
        total = dataset_length(sampler.dataset) - self._epoch_start
        world = sampler.num_replicas
        if isinstance(sampler, ResumableSampler):  # whole batches dealt: rank r's rows sit together
            return [
                sum(1 for j in range(batch) if sampler.position(self.batch_index, r, j) < total) for r in range(world)
            ]
        # A user's own DistributedSampler deals round-robin: rank r's j-th sample of this batch sits at position
        # (start + j) * world + r of the padded index list; positions >= the data's count repeat earlier samples.
        start = self.batch_index * batch
        size = min(batch, len(sampler) - start)
        return [sum(1 for j in range(size) if (start + j) * world + r < total) for r in range(world)]

    def interleaved(self) -> bool:
        """Whether the ranks' samples alternate in the data's order (a round-robin sampler) rather than following
        each other batch by batch."""
        sampler = self.loader.sampler
        return isinstance(sampler, DistributedSampler) and not (
            isinstance(sampler, ResumableSampler) and sampler.batch_size > 1
        )


def _stream_place(loader: DataLoader) -> Any:
    """An iterable dataset's own place in its stream (`state_dict()`, as `datasets`' and torchdata's stateful
    datasets keep it), where it is read in this process and fits a checkpoint's JSON; else None."""
    stream = getattr(loader.dataset, "state_dict", None)
    if not isinstance(loader.dataset, IterableDataset) or not callable(stream) or loader.num_workers > 0:
        return None
    place = stream()
    try:
        json.dumps(place)
    except (TypeError, ValueError):
        return None
    return place


def shard_dataloader(
    loader: DataLoader,
    *,
    dp_rank: int,
    dp_size: int,
    seed: int,
    device: torch.device,
    state: GradientState,
    sizes: list[int] | None = None,
) -> ShardedLoader:
    """Wrap `loader` so that each of the `dp_size` data-parallel ranks reads a disjoint part of the data;
    with `sizes` (one per dp rank) each global batch is split unevenly (`meshkit.data.uneven`)."""
    if isinstance(loader.sampler, DistributedSampler):
        return ShardedLoader(loader, device, state)  # already sharded by the user
    if isinstance(loader.dataset, IterableDataset):
        if dp_size > 1 and not getattr(loader.dataset, "sharded_by_rank", False):
            warnings.warn(
                "prepare(): an IterableDataset is not sharded automatically; every rank reads the same "
                "stream unless the dataset splits it by engine.dp_rank / engine.dp_size itself",
                stacklevel=3,
            )
        return ShardedLoader(loader, device, state)
    if loader.batch_size is None or not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise DataLoaderError(
            "prepare(): the DataLoader uses a custom sampler or batch_sampler; pass batch_size= and shuffle= "
            "instead, or give it a torch DistributedSampler(num_replicas=engine.dp_size, rank=engine.dp_rank)"
        )
    shuffle = isinstance(loader.sampler, RandomSampler)
    if sizes is not None:
        batches = UnevenBatchSampler(dataset_length(loader.dataset), sizes, dp_rank, shuffle=shuffle, seed=seed)
        return ShardedLoader(rebuilt(loader, batch_sampler=batches), device, state)
    sampler = ResumableSampler(
        loader.dataset,
        batch_size=loader.batch_size,
        num_replicas=dp_size,
        rank=dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=loader.drop_last,
    )
    sharded = rebuilt(loader, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last)
    return ShardedLoader(sharded, device, state)


def rebuilt(loader: DataLoader, **sampling: Any) -> DataLoader:
    """`loader` with other sampling arguments and all its other settings."""
    return DataLoader(
        loader.dataset,
        **sampling,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=_ignoring_interrupts(loader),
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers,
    )


def _ignoring_interrupts(loader: DataLoader) -> Any:
    """The loader's worker init, wrapped once in `IgnoreInterrupt` where it starts workers."""
    init = loader.worker_init_fn
    if loader.num_workers == 0 or isinstance(init, IgnoreInterrupt):
        return init
    return IgnoreInterrupt(init)


class IgnoreInterrupt:
    """A data-loading worker's init: Ctrl-C's SIGINT (sent to the terminal's whole process group) is left to the
    training process, which checkpoints and stops its workers itself; then the user's own `worker_init_fn`."""

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)


def endless(loader: Any) -> Iterator[Any]:
    """Batches over as many epochs as needed (each epoch reshuffled by the sharded loader)."""
    while True:
        yield from loader
