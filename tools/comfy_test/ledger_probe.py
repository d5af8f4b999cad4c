"""A custom node module the job_models check copies into its test server's custom_nodes/ (never shipped): a route
that shows ComfyUI's list of loaded models (`comfy.model_management.current_loaded_models`) as the server holds it,
with, for a running training job's entry, the job's name, how often the entry declined an unload and whether any
of the job's weights were moved to the meta device (freed)."""

from __future__ import annotations

import comfy.model_management
from aiohttp import web
from server import PromptServer

ROUTE = "/comfy_test/loaded_models"  # job_models_check.LEDGER_ROUTE
NODE_CLASS_MAPPINGS: dict = {}  # ComfyUI imports a custom node module for its mappings; this one adds a route only


def _row(entry) -> dict:
    """One ledger entry: its classes, device and the bytes ComfyUI counts for it (and its job, for a job's)."""
    patcher = entry.model
    row = {"entry": type(entry).__name__, "patcher": type(patcher).__name__, "device": str(entry.device),
           "bytes": entry.model_memory() if patcher is not None else 0}
    job = getattr(getattr(patcher, "model", None), "job", None)
    if job is not None:
        weights = [t for m in patcher.model.modules() for t in (*m.parameters(), *m.buffers())]
        row.update(job=job.name, declined=entry.declined, tensors=len(weights),
                   freed=sum(t.is_meta for t in weights))
    return row


@PromptServer.instance.routes.get(ROUTE)
async def loaded_models(request):
    return web.json_response([_row(entry) for entry in list(comfy.model_management.current_loaded_models)])
