"""Training jobs inside the ComfyUI server: LoRA delivery into `models/loras`, websocket events, the HTTP
routes of the live view, and checkpoints on shutdown.

Routes (under the pack's prefix, read by `web/qwen_edit_jobs.js`):
  GET  /qwen_edit/jobs                   every job: name, state, step, total, loss, loss history, output,
                                         delivered LoRA, URL of the latest validation image, the held-out
                                         pairs' errors per validation step (validation_metrics), and its
                                         outcome in words (a failure's reason; what a stop saved)
  GET  /qwen_edit/jobs/{name}/validation the job's latest validation image (PNG)
  POST /qwen_edit/jobs/{name}/stop       stop the job with a checkpoint (returns at once)
Websocket event `qwen_edit.job`: one job's entry (without the history, plus the step's loss point) on every
training step and state change.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from urllib.parse import quote

from qwen_edit_core import jobs, shutdown
from qwen_edit_core.common.files import temporary_name, writing

from . import comfy_runtime

log = logging.getLogger(__name__)

PREFIX = "/qwen_edit"
EVENT = "qwen_edit.job"


def deliver(lora_path: Path) -> Path:
    """Copy a finished run's LoRA into ComfyUI's loras folder (where stock LoRA loaders find it)."""
    target = comfy_runtime.loras_dir() / lora_path.name
    with writing(target, "the LoRA delivered to ComfyUI's loras folder", f"The run's own LoRA is intact at "
                 f"{str(lora_path)!r}; copy it there yourself once there is room."):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_name(target)
        try:
            with open(lora_path, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, target)  # ComfyUI never lists a partial LoRA under its name
        finally:
            tmp.unlink(missing_ok=True)
    log.info("LoRA delivered to %s", target)
    return target


def outcome(status: jobs.JobStatus) -> str:
    """What a finished job left, in words: a failure's reason, else its last checkpoint and where its LoRA went
    (a stopped or interrupted job's too); "" while it runs."""
    if status.state == "failed":
        return f"failed: {status.error}"
    if not status.finished:
        return ""
    saved = f"checkpoint {status.last_checkpoint.name} saved" if status.last_checkpoint else "no checkpoint saved"
    if status.delivered:
        return f"{saved}; LoRA {status.delivered.name} delivered to {status.delivered.parent}"
    return f"{saved}; LoRA written to {status.lora_path}" if status.lora_path else f"{saved}; no LoRA written"


def job_entry(job: jobs.TrainingJob, *, history: bool = True) -> dict:
    """One job as the UI sees it (JSON-ready), with its `outcome` in words."""
    status = job.status()
    entry = status.to_dict()
    entry["outcome"] = outcome(status)
    entry["validation_url"] = (f"{PREFIX}/jobs/{quote(job.name, safe='')}/validation?step="
                               f"{status.latest_validation.stem.removeprefix('step-')}"
                               if status.latest_validation else None)
    if history:
        entry["history"] = [[step, loss] for step, loss in job.history]
    return entry


def jobs_payload(registry: jobs.JobRegistry = jobs.REGISTRY) -> dict:
    """The body of GET /qwen_edit/jobs."""
    return {"jobs": [job_entry(job) for job in registry.jobs()]}


def send_job_event(job: jobs.TrainingJob, event: str) -> None:
    """Registry listener: push the job's entry (and the step's loss point) to every connected browser."""
    entry = job_entry(job, history=False)
    entry["event"] = event
    entry["point"] = [entry["step"], entry["loss"]] if entry["state"] == "training" else None
    comfy_runtime.send_event(EVENT, entry, broadcast=True)


def register_routes(routes, web, registry: jobs.JobRegistry = jobs.REGISTRY) -> None:
    """Add the routes to an aiohttp RouteTableDef (`PromptServer.instance.routes`); `web` is aiohttp.web."""

    @routes.get(f"{PREFIX}/jobs")
    async def list_jobs(request):
        return web.json_response(jobs_payload(registry))

    @routes.get(PREFIX + "/jobs/{name}/validation")
    async def validation(request):
        try:
            path = registry.get(request.match_info["name"]).status().latest_validation
        except jobs.JobNotFoundError as err:
            return web.json_response({"error": str(err)}, status=404)
        if path is None:
            return web.json_response({"error": "no validation image yet"}, status=404)
        return web.FileResponse(path)

    @routes.post(PREFIX + "/jobs/{name}/stop")
    async def stop(request):
        try:
            status = registry.stop(request.match_info["name"], wait=False)
        except jobs.JobNotFoundError as err:
            return web.json_response({"error": str(err)}, status=404)
        return web.json_response(status.to_dict())


def setup(registry: jobs.JobRegistry = jobs.REGISTRY) -> None:
    """Wire the registry to ComfyUI: delivery and events always; routes and shutdown checkpoints only
    inside a running ComfyUI server."""
    registry.set_delivery(deliver)
    registry.subscribe(send_job_event)
    server = comfy_runtime.prompt_server()
    if server is None:
        return
    from aiohttp import web
    register_routes(server.routes, web, registry)
    shutdown.install_shutdown_checkpoints(registry)
