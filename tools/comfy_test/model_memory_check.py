"""The pack's models in a real ComfyUI's memory manager (comfy/model_management.py, comfy/model_patcher.py of the
checkout): a Load Model node run twice with a changed widget, its first output still held (as ComfyUI's
"RAM pressure" and LRU caches hold it), leaves one live transformer; ComfyUI's list of loaded models holds the
three components of the live model only; ComfyUI's own `free_memory` unloads them (on the CPU, with nowhere to
offload them, their weights are freed), and the loader's IS_CHANGED makes ComfyUI load the model again. Runs in ComfyUI's Python on the CPU, on a temporary models folder."""

from __future__ import annotations

import subprocess
import tempfile

from comfy import PACK, limit

SCRIPT = """
import gc, sys, torch
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()  # as main.py does
import comfy.model_management as mm
import folder_paths
folder_paths.models_dir = MODELS  # the built-in tiny model is built here, not in the checkout
sys.path.insert(0, PACK)
import nodes as pack
from nodes import loaded_models
from nodes.common import TINY_MODEL
from diffusers import QwenImageTransformer2DModel

def load(**changed):
    widgets = {"model": TINY_MODEL, "transformer_device": "cpu", "vae_device": "cpu", "text_encoder_device": "cpu",
               "dtype": "float32", **changed}
    token = pack.QwenEditModelLoader.IS_CHANGED(unique_id="4", **widgets)
    with torch.inference_mode():
        return pack.QwenEditModelLoader().load_tracked(unique_id="4", **widgets)[0], token

def ours():
    return [e for e in mm.current_loaded_models if type(e.model).__name__ == "PackModelPatcher"]

first, token = load()
assert len(ours()) == 3, mm.current_loaded_models
second, changed = load(dtype="bfloat16")  # the widget changed; `first` stays referenced, as a cache holds it
assert changed != token
gc.collect()
live = [m for m in gc.get_objects() if isinstance(m, QwenImageTransformer2DModel) and not loaded_models.freed(m)]
assert live == [second.components.transformer], len(live)
assert {id(e.model.module) for e in ours()} == {id(m) for m in loaded_models.modules_of(second)}
assert all(e.model.model_size() > 0 and e.model.loaded_size() == e.model.model_size() for e in ours())
unloaded = mm.free_memory(1e30, torch.device("cpu"))  # ComfyUI's unload_all_models on a --cpu server
assert not ours() and len(unloaded) == 3
assert all(loaded_models.freed(m) for m in loaded_models.modules_of(second))  # nowhere to offload to: freed
third, again = load(dtype="bfloat16")  # the next run: IS_CHANGED differs, so ComfyUI runs the loader again
assert again != changed and len(ours()) == 3
print("two loads with a changed widget hold one transformer; ComfyUI lists its 3 components, its unload frees them "
      "and the loader loads them again")
"""


def check_model_memory(args) -> list[str]:
    """Run SCRIPT in ComfyUI's Python inside its checkout; its last line is the result."""
    with tempfile.TemporaryDirectory(prefix="qwen_edit_models_") as models:
        proc = subprocess.run([args.python, "-c", f"PACK = {str(PACK)!r}\nMODELS = {models!r}\n" + SCRIPT],
                              cwd=args.comfyui_dir, capture_output=True, text=True, timeout=limit(600), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"model-memory check failed:\n{proc.stderr[-3000:]}")
    return [proc.stdout.strip().splitlines()[-1]]
