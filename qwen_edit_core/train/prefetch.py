"""The training batches, each one's items read from the cache while the step before it runs.

`Prefetcher` draws the batch order from a `BucketBatchSampler` and hands `load(indices)` of the next batch to one
background thread as soon as the current batch is handed out, so a cache read (disk, safetensors) overlaps the
device's forward and backward instead of preceding them. The data position stays exact: `state_dict()` is the
sampler's position after the last batch handed out, never after the one read ahead, so a checkpoint resumes at
the batch an uninterrupted run would take next; `load_state_dict` drops what was read ahead.

Only what touches no shared state reads ahead (cache entries: a file read); encoding an example in real time
runs the encoders, on the device and with the global RNG, and stays in the loop's thread (`ahead=0`).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Drawn:
    """One batch: its example indices, the epoch they belong to, the sampler's position after them, and its
    items (read ahead, or read now)."""

    indices: list[int]
    epoch: int
    after: dict
    items: Future


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class Prefetcher:
    """Batches of `sampler` in order with `load(indices)` of up to `ahead` later batches already under way."""

    def __init__(self, sampler, load: Callable[[list[int]], list], ahead: int = 1):
        if ahead < 0:
            raise ValueError(f"Prefetcher ahead must be >= 0, got {ahead}")
        self.sampler, self.load, self.ahead = sampler, load, ahead
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batch-read") if ahead else None
        self._queue: deque[Drawn] = deque()
        self._position = sampler.state_dict()
        self._batches = iter(sampler)

    def _draw(self, now: bool) -> Drawn:
        indices = next(self._batches)
        epoch, after = self.sampler.epoch, self.sampler.state_dict()
        items = _done(self.load(indices)) if now or self._pool is None else self._pool.submit(self.load, indices)
        return Drawn(indices, epoch, after, items)

    def __iter__(self):
        return self

    def __next__(self) -> Drawn:
        """The next batch with its items read (waiting for the read ahead if it is still running); the read of
        the batches after it starts before this returns."""
        drawn = self._queue.popleft() if self._queue else self._draw(now=True)
        while len(self._queue) < self.ahead:
            self._queue.append(self._draw(now=False))
        items = drawn.items.result()  # a failed read raises here, before the position counts its batch
        self._position = drawn.after
        return Drawn(drawn.indices, drawn.epoch, drawn.after, _done(items))

    def state_dict(self) -> dict:
        """The sampler's position after the last batch handed out (what a checkpoint saves)."""
        return dict(self._position)

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: the batches read ahead are dropped and the order restarts there."""
        self.drop()
        self.sampler.load_state_dict(state)
        self._position = self.sampler.state_dict()
        self._batches = iter(self.sampler)

    def drop(self) -> None:
        """Forget the batches read ahead (waiting for a read under way, so no thread outlives the call)."""
        while self._queue:
            drawn = self._queue.popleft()
            if not drawn.items.cancel():
                drawn.items.exception()  # wait; a failed read ahead of a batch never taken is not an error

    def close(self) -> None:
        """Drop the read-ahead batches and stop the thread."""
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
