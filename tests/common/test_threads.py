"""The CPU thread count chosen for the CLI, the demo and ComfyUI jobs."""

import pytest
import torch

from qwen_edit_core.common.threads import checked_threads, default_threads, torch_threads


@pytest.mark.parametrize("cores, load, expected", [
    (2, 0.0, 1),      # a small machine: one thread whatever the load
    (4, 0.0, 1),
    (16, 0.0, 16),    # a quiet large machine: every core
    (16, 10.0, 6),    # a busy one: the cores the load leaves
    (16, 15.0, 1),    # saturated
])
def test_default_threads_follows_cores_and_load(cores, load, expected):
    assert default_threads(cores, load) == expected


def test_checked_threads_refuses_a_negative_count_naming_it():
    with pytest.raises(ValueError, match="threads=-2"):
        checked_threads(-2)
    assert checked_threads(3) == 3


def test_torch_threads_sets_and_restores():
    before = torch.get_num_threads()
    with torch_threads(1) as used:
        assert used == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("configured, expected", [(1, 1), (3, 3), (0, None)])
def test_a_training_job_runs_with_its_configured_threads_and_leaves_the_callers(tmp_path, configured, expected):
    """The job's thread trains with `train.cpu_threads` (0: `default_threads()`); the thread that started it keeps
    its own count (ComfyUI's worker samples beside a running job)."""
    from qwen_edit_core import jobs
    from qwen_edit_core.config import load_config
    from qwen_edit_core.train.loop import TrainResult

    seen = []

    def fit(config, *, resume, progress, cancel, lock=None, model=None):
        seen.append(torch.get_num_threads())
        return TrainResult(state="done", step=0, lora_path=None, loss_plot=None)

    config = load_config(overrides={"train": {"output_dir": str(tmp_path / "run"), "cpu_threads": configured}})
    before = torch.get_num_threads()
    job = jobs.TrainingJob(config, fit=fit, preflight=lambda config, resume: None).start()
    assert job.wait(timeout=60).state == "done"
    assert seen == [expected if expected is not None else default_threads()]
    assert torch.get_num_threads() == before
