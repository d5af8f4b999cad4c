"""The fault soak's short form: a kill inside a checkpoint write and a second run on a busy output directory,
each recovered to the uninterrupted run's LoRA bit for bit (`qwen-edit bench soak` runs every fault)."""

from __future__ import annotations


def test_soak_short_form_recovers_every_fault_bit_exactly(tmp_path):
    from qwen_edit_core.bench.soak import soak
    report = soak(rounds=1, faults=("kill-checkpoint", "second-run"), seed=1, work=tmp_path)
    assert report.injected == 2 and report.recovered == 2 and report.max_diff == 0.0, report.rows
