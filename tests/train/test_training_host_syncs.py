"""The training loop reads device values on the host (a GPU sync each) once per logging interval, whatever
happens inside a step (accumulation, clipping, the non-finite guard, several processes), plus checkpoint steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import train_config
from host_reads import count_training_reads

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _logging_reads(reads: dict, steps: int) -> dict:
    """The reads made during the optimizer steps, by step (setup and checkpoint writing left out)."""
    return {tag: where for tag, where in reads.items() if tag not in ("setup", "checkpoint")}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_whole_training_loop_reads_the_device_once_per_logging_interval(tiny_edit_dir, pairs_dir, tmp_path,
                                                                           monkeypatch, accumulation):
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path, logging={"every": 3}, train={
        "max_steps": 7, "gradient_accumulation_steps": accumulation, "mixed_precision": "bf16",
        "max_grad_norm": 1.0, "checkpoint_every": 4, "ema_decay": 0.9})
    counted = count_training_reads(config, monkeypatch)
    assert counted["result"].step == 7 and [s for s, _ in counted["result"].history] == [3, 4, 6, 7]
    # one read at each logging step (3, 6), at the checkpoint step (4) and at the last step (7); none elsewhere
    reads = _logging_reads(counted["reads"], 7)
    assert {tag: len(where) for tag, where in reads.items()} == {"step 3": 1, "step 4": 1, "step 6": 1,
                                                                 "step 7": 1}, reads


TWO_PROCESSES = """
import json, os, sys
sys.path[:0] = [{tests!r}, os.path.join({tests!r}, "train")]
import pytest
from conftest import train_config
from host_reads import count_training_reads
from pathlib import Path
rank = int(os.environ["RANK"])
mp = pytest.MonkeyPatch()
config = train_config(Path({model!r}), Path({data!r}), Path({out!r}), cache_dir=Path({out!r}) / "cache",
                      logging={{"every": 3}}, data={{"batch_size": 2}},
                      train={{"max_steps": 7, "gradient_accumulation_steps": 2, "checkpoint_every": 4}})
counted = count_training_reads(config, mp)
Path({out!r}, f"reads{{rank}}.json").write_text(json.dumps({{
    "step": counted["result"].step, "reads": counted["reads"]}}))
"""


@pytest.mark.slow  # accelerate launch: two processes
def test_two_processes_read_the_device_once_per_logging_interval(tiny_edit_dir, pairs_dir, tmp_path):
    """With two processes, the loss read is also where the processes agree on a stop (one all-reduce): no
    per-micro-step collective and read for cancellation, no per-step read for the non-finite guard."""
    script = tmp_path / "count.py"
    script.write_text(TWO_PROCESSES.format(tests=TESTS, model=str(tiny_edit_dir), data=str(pairs_dir),
                                           out=str(tmp_path)))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(TESTS)}
    proc = subprocess.run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", str(script)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        counted = json.loads((tmp_path / f"reads{rank}.json").read_text())
        assert counted["step"] == 7
        reads = _logging_reads(counted["reads"], 7)
        assert {tag: len(where) for tag, where in reads.items()} == {"step 3": 1, "step 4": 1, "step 6": 1,
                                                                     "step 7": 1}, (rank, reads)
