"""The doctor's one pool of helper processes (runner.PairMeasurer) also reads and measures the pairs the dataset
reader did not hand over: the same measures as in this process, the cache's pairs not measured again, and no
helper process left after an error."""

from __future__ import annotations

import multiprocessing

import pytest

from qwen_edit_core.data.dataset import load_dataset
from qwen_edit_core.data.doctor import runner
from qwen_edit_core.data.synthetic import DEMO_EDIT, write_pairs


@pytest.fixture
def examples(tmp_path):
    write_pairs(tmp_path / "pairs", 9, 0, DEMO_EDIT[0], 64)
    return list(load_dataset(tmp_path / "pairs").examples)


def test_unread_pairs_are_measured_by_the_one_pool_as_here(examples, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "_BATCH", 2)  # five batches, at most four waiting on two helpers
    here = runner.measure_all(examples, runner.PairMeasurer())
    started, returned, tasks, real_pool = [], [], [], runner.ProcessPoolExecutor

    class Pool(real_pool):  # keeps what each task returns, whatever start method the helper processes have
        def submit(self, task, *args):
            tasks.append(args)
            returned.append(super().submit(task, *args))
            return returned[-1]
    monkeypatch.setattr(runner, "ProcessPoolExecutor", lambda **kw: started.append(kw) or Pool(**kw))
    steps = []
    with runner.PairMeasurer(tmp_path / "cache", workers=2) as measured:
        pooled = runner.measure_all(examples, measured, progress=lambda done, total: steps.append((done, total)))
    assert [kw["max_workers"] for kw in started] == [2] and pooled == here
    assert steps == [(n, 9) for n in (2, 4, 6, 8, 9)]
    returned.clear()
    with runner.PairMeasurer(tmp_path / "cache", workers=2) as warm:  # every pair's measures in the cache
        assert runner.measure_all(examples, warm) == here
    # the helpers measured nothing: each pair's key came back without measures; the cache's keys reached each
    # helper once, when it started, and no task carried them
    assert len(returned) == 5 and [m for f in returned for _, m in f.result()] == [None] * 9
    assert started[-1]["initargs"] == (frozenset(warm.cached),) and len(warm.cached) == 9
    assert all(len(args) == 1 for args in tasks[-5:])


def test_an_error_in_a_helper_leaves_no_helper_process(examples, monkeypatch):
    monkeypatch.setattr(runner, "_BATCH", 2)
    examples[5].target.unlink()  # read by a helper in the third batch
    before = set(multiprocessing.active_children())
    with pytest.raises(FileNotFoundError, match=examples[5].target.name):
        runner.diagnose(examples, workers=2)
    assert set(multiprocessing.active_children()) <= before
