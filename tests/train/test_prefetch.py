"""The batch read-ahead: the same batches and items as reading each batch when taken, the next batch's read under
way before it is asked for, and a data position that never counts the batch read ahead."""

from __future__ import annotations

import threading

import pytest

from qwen_edit_core.data.buckets import BucketBatchSampler
from qwen_edit_core.train.prefetch import Prefetcher

KEYS = [(64, 64)] * 5 + [(96, 64)] * 4  # two buckets, batches of 2 over three epochs below


def _sampler():
    return BucketBatchSampler(KEYS, batch_size=2, seed=7)


def _plain(n: int, start: dict | None = None):
    """The first `n` batches of a sampler (from `start`) and its position after each."""
    sampler = _sampler()
    if start is not None:
        sampler.load_state_dict(start)
    batches, positions, it = [], [], iter(sampler)
    for _ in range(n):
        batches.append(next(it))
        positions.append(sampler.state_dict())
    return batches, positions


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_read_ahead_gives_the_sampler_batches_and_positions(ahead):
    batches, positions = _plain(14)  # several epochs
    prefetch = Prefetcher(_sampler(), lambda indices: [f"item {i}" for i in indices], ahead=ahead)
    try:
        for expected, position in zip(batches, positions):
            drawn = next(prefetch)
            assert drawn.indices == expected and drawn.items.result() == [f"item {i}" for i in expected]
            assert prefetch.state_dict() == position == drawn.after  # never the batch read ahead
            assert drawn.epoch == position["epoch"]
        # a rewind (a cancelled step) drops what was read ahead and continues exactly there
        prefetch.load_state_dict(positions[5])
        assert [next(prefetch).indices for _ in range(4)] == batches[6:10]
        assert prefetch.state_dict() == positions[9]
    finally:
        prefetch.close()


def test_the_next_batch_is_read_while_the_current_one_is_used():
    reading, release = threading.Event(), threading.Event()
    calls = []

    def load(indices):
        calls.append(list(indices))
        if len(calls) == 2:  # the read ahead of the second batch: hold it until the test has seen it start
            reading.set()
            assert release.wait(60), "the test never released the read"
        return list(indices)

    prefetch = Prefetcher(_sampler(), load, ahead=1)
    try:
        first = next(prefetch)
        # the second batch's read started in the background before anyone asked for it
        assert reading.wait(60), "the next batch's read did not start"
        assert calls == [first.indices, calls[1]] and calls[1] != first.indices
        release.set()
        second = next(prefetch)
        assert second.items.result() == calls[1] == second.indices
    finally:
        release.set()
        prefetch.close()


def test_a_failed_read_is_raised_when_its_batch_is_taken():
    def load(indices):
        if len(indices) and indices[0] == _plain(2)[0][1][0]:
            raise OSError("disk gone")
        return indices

    prefetch = Prefetcher(_sampler(), load, ahead=1)
    try:
        next(prefetch)
        after_first = prefetch.state_dict()
        with pytest.raises(OSError, match="disk gone"):
            next(prefetch)
        assert prefetch.state_dict() == after_first  # the batch that failed to read is not counted as taken
    finally:
        prefetch.close()
