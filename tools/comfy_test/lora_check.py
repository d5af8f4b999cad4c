"""Our LoRA files in a real ComfyUI: stock `LoraLoaderModelOnly` on ComfyUI's own Qwen-Image model patches every
adapted layer with the weight our peft adapter applies, for each kind we train (LoRA, LoKr with full and with
low-rank factors, LoHa, DoRA), with no "lora key not loaded" (a file with a stray key shows the warning is
caught); at strength 0.5 ComfyUI's weight equals our loader's.

Runs in ComfyUI's Python, in its checkout (no server): a real-width one-block transformer (seeded, ComfyUI detects
Qwen-Image from the real widths), saved as a diffusion_models file and loaded with `comfy.sd.load_diffusion_model`;
each adapter is injected with the pack's own code, its factors moved randomly (as after training), saved with
`save_lora`, then applied by the stock node and the patched weights read back (`ModelPatcher.patch_model`).
Standalone: `python tools/comfy_test/lora_check.py --comfyui-dir ~/ComfyUI --python ~/ComfyUI/venv/bin/python`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from comfy import limit

PACK = Path(__file__).resolve().parents[2]
#: (label, type, dora, rank): LoKr rank 64 keeps every factor full at width 3072 (48x48 and 64x64, 64 >= 64 / 2),
#: rank 16 makes w2 low-rank
KINDS = [("lora", "lora", False, 8), ("lokr-full", "lokr", False, 64), ("lokr-lowrank", "lokr", False, 16),
         ("loha", "loha", False, 8), ("dora", "lora", True, 8)]
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "img_mlp.net.2"]
TOLERANCE = 1e-5  # relative to the largest weight change

CODE = r"""
import copy, json, logging, sys, torch
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
sys.path.append(PACK)  # after ComfyUI's own modules: its nodes.py, not the pack's nodes/
import comfy.sd, folder_paths, nodes
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import save_file
from qwen_edit_core.adapters import lora
from qwen_edit_core.families.qwen_image.tiny import transformer_config

WORK, KINDS, TARGETS = sys_work, sys_kinds, sys_targets
not_loaded = []
class Catch(logging.Handler):
    def emit(self, record):
        if "lora key not loaded" in record.getMessage():
            not_loaded.append(record.getMessage())
logging.getLogger().addHandler(Catch())
torch.manual_seed(0)
base = QwenImageTransformer2DModel(**transformer_config("real-width")).eval().requires_grad_(False)
save_file({k: v.contiguous() for k, v in base.state_dict().items()}, f"{WORK}/qwen_check.safetensors")
folder_paths.add_model_folder_path("loras", WORK)
comfy_model = comfy.sd.load_diffusion_model(f"{WORK}/qwen_check.safetensors", model_options={"dtype": torch.float32})
results = {}
for label, kind, dora, rank in KINDS:
    model = copy.deepcopy(base)
    spec = lora.LoraSpec(rank=rank, alpha=rank / 2, targets=tuple(TARGETS), type=kind, dora=dora)
    lora.inject_lora(model, spec)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora.adapter_layers(model).values():
            for p in lora.adapter_parameters(layer, "default"):
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    name = f"qwen_check_{label}.safetensors"
    lora.save_lora(f"{WORK}/{name}", model, spec, base_identity="check", steps=1)
    keys = sorted({k.rsplit(".", 2)[-2] if k.endswith(".weight") else k.rsplit(".", 1)[-1]
                   for k in lora.lora_state_dict_comfy(model)})
    layers = list(lora.adapter_layers(model))
    with torch.no_grad():
        lora.merge_lora(model)  # peft's own weight: W + delta (DoRA: its magnitude rule)
    ours = {n: model.get_submodule(n).get_base_layer().weight.detach().clone() for n in layers}
    del model
    half = copy.deepcopy(base)
    lora.load_lora_file(half, f"{WORK}/{name}", adapter_name="f", strength=0.5)
    with torch.no_grad():
        lora.merge_lora(half)
    ours_half = {n: half.get_submodule(n).get_base_layer().weight.detach().clone() for n in layers}
    del half
    row = {"keys": keys, "layers": len(layers)}
    before = len(not_loaded)
    for strength, expected in ((1.0, ours), (0.5, ours_half)):
        patched = nodes.LoraLoaderModelOnly().load_lora_model_only(comfy_model, name, strength)[0]
        patched_keys = {k for k in patched.patches}
        patched.patch_model()
        diff = patched.model.diffusion_model
        err, scale, missing = 0.0, 0.0, []
        for n in layers:
            if f"diffusion_model.{n}.weight" not in patched_keys:
                missing.append(n)
                continue
            delta = expected[n] - base.get_submodule(n).weight
            err = max(err, (diff.get_submodule(n).weight.float() - expected[n]).abs().max().item())
            scale = max(scale, delta.abs().max().item())
        patched.unpatch_model()
        row[f"strength {strength}"] = {"max_err": err, "max_delta": scale, "unpatched_layers": missing,
                                       "patched_keys": len(patched_keys)}
    row["not_loaded"] = not_loaded[before:]
    results[label] = row
# control: a key no layer takes is reported (the catch above sees ComfyUI's warning)
from safetensors.torch import load_file
extra = load_file(f"{WORK}/qwen_check_lora.safetensors")
extra["diffusion_model.no_such_layer.lora_down.weight"] = torch.zeros(8, 8)
save_file(extra, f"{WORK}/qwen_check_control.safetensors")
before = len(not_loaded)
nodes.LoraLoaderModelOnly().load_lora_model_only(comfy_model, "qwen_check_control.safetensors", 1.0)
results["control"] = {"not_loaded": not_loaded[before:]}
print("RESULT " + json.dumps(results))
"""


def run_check(comfyui_dir: Path, python: str) -> dict:
    """Run the check in ComfyUI's Python; returns {label: {keys, layers, strength 1.0/0.5: errors, not_loaded}}."""
    with tempfile.TemporaryDirectory(prefix="qwen_lora_check_") as work:
        code = (CODE.replace("PACK)", f"{str(PACK)!r})").replace("sys_work", repr(work))
                .replace("sys_kinds", repr(KINDS)).replace("sys_targets", repr(TARGETS)))
        proc = subprocess.run([python, "-c", code], cwd=comfyui_dir, capture_output=True, text=True,
                              timeout=limit(3600))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the LoRA check failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def check_lora_kinds(args) -> list[str]:
    results = run_check(args.comfyui_dir, args.python)
    control = results.pop("control")["not_loaded"]
    assert len(control) == 1 and "no_such_layer" in control[0], f"the not-loaded catch missed a bad key: {control}"
    lines, bad = [f"control: a stray key is reported by ComfyUI ({control[0]!r})"], []
    for label, row in results.items():
        for strength in ("strength 1.0", "strength 0.5"):
            r = row[strength]
            rel = r["max_err"] / max(r["max_delta"], 1e-30)
            if row["not_loaded"] or r["unpatched_layers"] or rel > TOLERANCE:
                bad.append(f"{label} {strength}: {r}, not loaded {row['not_loaded'][:3]}")
            lines.append(f"{label} ({', '.join(row['keys'])}): LoraLoaderModelOnly {strength} patched "
                         f"{row['layers'] - len(r['unpatched_layers'])}/{row['layers']} layers, max |ComfyUI - ours| "
                         f"{r['max_err']:.2e} for changes up to {r['max_delta']:.2e} ({rel:.1e} relative), "
                         f"{len(row['not_loaded'])} keys not loaded")
    assert not bad, "; ".join(bad)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui-dir", type=Path, required=True, help="a ComfyUI checkout (holds main.py)")
    parser.add_argument("--python", default=sys.executable, help="the Python of ComfyUI's environment")
    args = parser.parse_args(argv)
    for line in check_lora_kinds(args):
        print(f"PASS lora: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
