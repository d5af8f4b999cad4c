"""Aspect buckets and the resumable bucketed batch sampler."""

from __future__ import annotations

import logging
import random
from typing import Hashable, Iterator, Sequence

from qwen_edit_core.model.geometry import bucket_for, calculate_dimensions  # noqa: F401  (bucket keys)

log = logging.getLogger(__name__)



class BucketBatchSampler:
    """Endless batches of indices with equal bucket keys; deterministic per (seed, epoch); resumable.

    Each epoch groups the indices by key, shuffles each group, cuts it into batches and shuffles the batches,
    all from a generator seeded by (seed, epoch) alone, so any epoch can be rebuilt without replaying the ones
    before. `state_dict()` after k batches, loaded into a new sampler over the same keys, continues with batch
    k+1 of the same sequence: a resumed run sees exactly the batches of an uninterrupted one.
    """

    def __init__(self, bucket_keys: Sequence[Hashable], batch_size: int, seed: int, drop_last: bool = False,
                 shuffle: bool = True, sizes: Sequence[int] | None = None,
                 groups: Sequence[Hashable] | None = None):
        """`sizes` (token counts per sample) switches to similar-size grouping: samples are ordered by size
        and cut into batches, so a batch may mix neighbouring sizes (padded by the trainer) instead of
        leaving many part-filled batches of one exact size. `groups` (with `sizes`; e.g. each sample's number
        of control images) keeps every batch inside one group."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not bucket_keys:
            raise ValueError("no samples to batch (bucket_keys is empty)")
        if sizes is not None and len(sizes) != len(bucket_keys):
            raise ValueError(f"sizes has {len(sizes)} entries for {len(bucket_keys)} samples")
        if groups is not None and (sizes is None or len(groups) != len(bucket_keys)):
            raise ValueError("groups needs sizes and one group per sample")
        self.keys = list(bucket_keys)
        self.sizes = list(sizes) if sizes is not None else None
        self.groups = list(groups) if groups is not None else None
        self.batch_size, self.seed, self.drop_last, self.shuffle = batch_size, int(seed), drop_last, shuffle
        self.epoch, self.index = 0, 0

    def _rng(self, epoch: int) -> random.Random:
        # A string seed is hashed with SHA-512: distinct (seed, epoch) pairs give independent streams, the
        # same on every process and Python run (no PYTHONHASHSEED dependence).
        return random.Random(f"bucket-batch-sampler:{self.seed}:{epoch}")

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The batches of `epoch`, in order (the same for the same keys, batch size, seed and epoch)."""
        rng = self._rng(epoch)
        batches = self._similar_batches(rng) if self.sizes is not None else self._equal_batches(rng)
        if self.shuffle:
            rng.shuffle(batches)
        if not batches:
            raise ValueError(f"no full batch of {self.batch_size} in any bucket with drop_last; lower the batch "
                             "size or add samples")
        return batches

    def _equal_batches(self, rng: random.Random) -> list[list[int]]:
        groups: dict[Hashable, list[int]] = {}
        for i, key in enumerate(self.keys):
            groups.setdefault(key, []).append(i)
        batches = []
        for key in sorted(groups, key=repr):  # a fixed group order: hash order of keys may vary across runs
            members = groups[key]
            if self.shuffle:
                rng.shuffle(members)
            batches += self._cut(members)
        return batches

    def _similar_batches(self, rng: random.Random) -> list[list[int]]:
        order = list(range(len(self.keys)))
        if self.shuffle:
            rng.shuffle(order)
        # Stable sort by (size, bucket): equal buckets stay together, neighbours in size come next.
        order.sort(key=lambda i: (self.sizes[i], repr(self.keys[i])))
        if self.groups is None:
            return self._cut(order)
        batches = []
        for group in sorted(set(self.groups), key=repr):
            batches += self._cut([i for i in order if self.groups[i] == group])
        return batches

    def _cut(self, indices: list[int]) -> list[list[int]]:
        batches = [indices[i:i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        """Batches from the current position on, across epochs, endlessly; the position advances as they go."""
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.index < len(batches):
                batch = batches[self.index]
                self.index += 1
                yield batch
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """The position as plain ints: the epoch and the number of its batches already yielded (plus the
        sample count and batch size, to warn when a resume sees other data)."""
        return {"epoch": self.epoch, "index": self.index, "num_samples": len(self.keys),
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()`: the next batch is the one an uninterrupted run would yield next."""
        epoch, index = state.get("epoch"), state.get("index")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, index)):
            raise ValueError(f"sampler state needs non-negative integers 'epoch' and 'index', got {state!r}")
        here = {"num_samples": len(self.keys), "batch_size": self.batch_size}
        changed = {k: (state[k], v) for k, v in here.items() if k in state and state[k] != v}
        if changed:
            log.warning("resuming the batch order with other data (%s): batches differ from the original run",
                        ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        self.epoch, self.index = epoch, index
