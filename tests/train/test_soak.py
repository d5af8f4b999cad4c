"""The fault soak's short form: a kill inside a checkpoint write and a second run on a busy output directory,
each recovered to the uninterrupted run's LoRA bit for bit (`qwen-edit bench soak` runs every fault)."""

from __future__ import annotations

import pytest


def test_soak_short_form_recovers_every_fault_bit_exactly(tmp_path):
    from qwen_edit_core.bench.soak import soak
    report = soak(rounds=1, faults=("kill-checkpoint", "second-run"), seed=1, work=tmp_path)
    assert report.injected == 2 and report.recovered == 2 and report.max_diff == 0.0, report.rows


@pytest.mark.slow
def test_soak_sigterm_and_read_only_checkpoints_recover_bit_exactly(tmp_path):
    """SIGTERM during a step: the run ends the step, checkpoints, exits 143, and resumes bit-exactly; the
    checkpoints folder made read-only mid-run: the run fails naming the write, and resumes bit-exactly."""
    from qwen_edit_core.bench.soak import soak
    report = soak(rounds=1, faults=("sigterm-step", "read-only"), seed=1, work=tmp_path)
    assert report.injected == 2 and report.recovered == 2 and report.max_diff == 0.0, report.rows
    notes = dict((kind, note) for kind, note, _ in report.rows)
    assert "exit 143" in notes["sigterm-step"], notes
    assert "read-only" in notes["read-only"] and "OutputWriteError: could not write checkpoint" in notes["read-only"]


@pytest.mark.slow
def test_soak_kills_inside_a_cache_write_and_a_step_recover_bit_exactly(tmp_path):
    """SIGKILL inside a cache entry's write (the entry is whole in its temporary file, not yet renamed) and during
    a training step: each run, resumed, ends with the uninterrupted run's LoRA bit for bit."""
    from qwen_edit_core.bench.soak import soak
    report = soak(rounds=1, faults=("kill-cache", "kill-step"), seed=1, work=tmp_path)
    assert report.injected == 2 and report.recovered == 2 and report.max_diff == 0.0, report.rows


def test_soak_signals_during_validation_and_the_cache_stage_recover_bit_exactly(tmp_path):
    """Two SIGTERMs during a validation pass (the checkpoint holds that step's boundary) and a SIGTERM inside a
    cache write (the run stops at once, exit 143): each run, resumed, ends with the uninterrupted run's LoRA."""
    from qwen_edit_core.bench.soak import soak
    report = soak(rounds=1, faults=("sigterm-validation", "sigterm-cache"), seed=1, work=tmp_path)
    assert report.injected == 2 and report.recovered == 2 and report.max_diff == 0.0, report.rows
    assert all("exit 143" in note for _, note, _ in report.rows), report.rows
