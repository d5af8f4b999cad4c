"""The Train node's request to ComfyUI, in a real ComfyUI: `comfy_runtime.free_device_memory("cuda")` goes through
ComfyUI's own `comfy.model_management.free_memory` and unloads the models ComfyUI holds on cuda:0 (and only
those), as before a training job starts. Runs in ComfyUI's Python on a CPU: two stand-in loaded models (one on
cuda:0, one on cuda:1) are put into ComfyUI's list of loaded models, and smart memory is off so that ComfyUI does
not ask CUDA for its free memory (it unloads every model of the device then, as it does with
--disable-smart-memory)."""

from __future__ import annotations

import subprocess

from comfy import PACK, limit

SCRIPT = """
import sys, torch
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()  # as main.py does
import comfy.model_management as mm
sys.path.insert(0, PACK)
from nodes import comfy_runtime

class Stand_in:
    def __init__(self, device):
        self.device, self.unloaded, self.currently_used = torch.device(device), False, True
        self.model = self  # ComfyUI logs model.model's class name
    def is_dead(self): return False
    def real_model(self): return self
    def model_offloaded_memory(self): return 0
    def model_memory(self): return 1 << 30
    def model_unload(self, memory_to_free=None, unpatch_weights=True):
        self.unloaded = True
        return True

first, other = Stand_in("cuda:0"), Stand_in("cuda:1")
mm.current_loaded_models[:] = [first, other]
mm.DISABLE_SMART_MEMORY = True
assert comfy_runtime.in_comfy()
assert comfy_runtime.free_device_memory("cuda")  # "cuda" is cuda:0, as ComfyUI names it
assert first.unloaded and not other.unloaded, (first.unloaded, other.unloaded)
assert mm.current_loaded_models == [other]
assert not comfy_runtime.free_device_memory("cpu")
print("unloaded the cuda:0 model, kept the cuda:1 one")
"""


def check_free_memory(args) -> list[str]:
    """Run SCRIPT in ComfyUI's Python inside its checkout; its last line is the result."""
    proc = subprocess.run([args.python, "-c", f"PACK = {str(PACK)!r}\n" + SCRIPT], cwd=args.comfyui_dir,
                          capture_output=True, text=True, timeout=limit(300), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"free-memory check failed:\n{proc.stderr[-3000:]}")
    return [proc.stdout.strip().splitlines()[-1]]
