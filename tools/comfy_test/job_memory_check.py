"""A running training job in a real ComfyUI's memory manager (comfy/model_management.py of the checkout): while
the job trains on a loaded model, ComfyUI's list of loaded models holds one entry for it that reports what the job
holds, and ComfyUI's own `free_memory` (what loading a prompt's model calls) and `unload_all_models` (its "Unload
models") leave that entry listed and the job's weights where they are; once the job is over, ComfyUI unloads it
like any model. Runs in ComfyUI's Python on the CPU (the job holds its run until released), on a temporary
models folder."""

from __future__ import annotations

import subprocess
import tempfile

from comfy import PACK, limit

SCRIPT = """
import sys, threading, torch
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()  # as main.py does
import comfy.model_management as mm
import folder_paths
folder_paths.models_dir = MODELS  # the built-in tiny model is built here, not in the checkout
sys.path.insert(0, PACK)
import nodes as pack
from nodes import comfy_runtime, loaded_models
from nodes.common import TINY_MODEL
from qwen_edit_core import jobs
from qwen_edit_core.config import load_config
from qwen_edit_core.train.loop import TrainResult

widgets = {"model": TINY_MODEL, "transformer_device": "cpu", "vae_device": "cpu", "text_encoder_device": "cpu",
           "dtype": "float32"}
with torch.inference_mode():
    handle = pack.QwenEditModelLoader().load_tracked(unique_id="1", **widgets)[0]
modules = loaded_models.modules_of(handle)
before = {id(m): [p.data_ptr() for p in m.parameters()] for m in modules}
started, release = threading.Event(), threading.Event()

def held(config, *, resume, progress, cancel, lock=None, model=None):
    started.set()
    release.wait(300)
    return TrainResult(state="done", step=0, lora_path=None, loss_plot=None)

jobs.REGISTRY = jobs.JobRegistry(fit=held, preflight=lambda config, resume: None)
job = jobs.REGISTRY.start(load_config(overrides={"train": {"output_dir": RUN, "device": "cpu"}}),
                          model=handle.components)
assert started.wait(300)
assert comfy_runtime.count_job(job, modules, torch.device("cpu"))
entries = [e for e in mm.current_loaded_models if type(e).__name__ == "PackJobEntry"]
assert len(entries) == 1 and len(mm.current_loaded_models) == 1, mm.current_loaded_models
weights = job.device_bytes()
assert entries[0].model_memory() == weights > 0
assert mm.free_memory(1e30, torch.device("cpu")) == []  # a prompt's model needs all the room
mm.unload_all_models()  # ComfyUI's "Unload models" (its default device is the CPU with --cpu)
assert mm.current_loaded_models == entries and entries[0].model_memory() == weights
assert {id(m): [p.data_ptr() for p in m.parameters()] for m in modules} == before  # the job's weights stayed
release.set()
job.wait()
assert len(mm.free_memory(1e30, torch.device("cpu"))) == 1 and not mm.current_loaded_models
print(f"ComfyUI kept the running job's entry ({weights / 2**20:.1f} MiB) through free_memory and "
      "unload_all_models, and dropped it once the job was over")
"""


def check_job_memory(args) -> list[str]:
    """Run SCRIPT in ComfyUI's Python inside its checkout; its last line is the result."""
    with tempfile.TemporaryDirectory(prefix="qwen_edit_models_") as models, \
            tempfile.TemporaryDirectory(prefix="qwen_edit_run_") as run:
        proc = subprocess.run([args.python, "-c", f"PACK = {str(PACK)!r}\nMODELS = {models!r}\nRUN = {run!r}\n"
                               + SCRIPT], cwd=args.comfyui_dir, capture_output=True, text=True,
                              timeout=limit(600), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"job-memory check failed:\n{proc.stderr[-3000:]}")
    return [proc.stdout.strip().splitlines()[-1]]
