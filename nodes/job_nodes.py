"""Nodes over the server's training jobs: stop one with a checkpoint, list them all."""

from __future__ import annotations

from qwen_edit_core import jobs

from .common import CATEGORY, JOB
from .job_service import outcome
from .train_nodes import find_job


def _line(status: jobs.JobStatus) -> str:
    loss = f"{status.loss:.4f}" if status.loss is not None else "-"
    out = status.delivered or status.lora_path or status.output_dir
    said = outcome(status)
    return (f"{status.name}: {status.state}, step {status.step}/{status.total}, loss {loss}, output {out}"
            + (f" ({said})" if said else ""))


class QwenEditStopTraining:
    """Stop a training job (by its JOB link or its name): it saves a checkpoint at the current step, writes
    its LoRA and puts it into models/loras. Queue the Train node again with resume on to continue."""

    DESCRIPTION = __doc__
    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["stop training", "cancel training", "checkpoint"]
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("status",)
    FUNCTION = "stop"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"job_name": ("STRING", {"default": "", "tooltip": "the job to stop: the Train "
                                                     "node's lora_name (or job_name); ignored when job is "
                                                     "connected"})},
                "optional": {"job": (JOB, {"tooltip": "the Train node's job output"})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # stopping is an action: run it every time it is queued

    def stop(self, job_name, job=None):
        job = find_job(job, job_name)
        job.stop()
        status = job.wait()
        text = _line(status)
        return {"ui": {"text": [text]}, "result": (text,)}


class QwenEditJobs:
    """Every training job of this server (running or finished): state, step, loss and output."""

    DESCRIPTION = __doc__
    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["training jobs", "list jobs", "job list"]
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("jobs",)
    FUNCTION = "list"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # the jobs move on between runs

    def list(self):
        lines = [_line(status) for status in jobs.REGISTRY.statuses()] or ["no training jobs"]
        text = "\n".join(lines)
        return {"ui": {"text": [text]}, "result": (text,)}
