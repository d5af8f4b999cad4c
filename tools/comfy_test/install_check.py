"""What ComfyUI-Manager does on install, checked: `pip install -r requirements.txt` with ComfyUI's Python
leaves its torch and torchvision as they were; the versions before and after are reported."""

from __future__ import annotations

import json
import subprocess

from comfy import PACK

VERSIONS = ("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) if any(True for _ in "
            "m.distributions(name=p)) else None for p in ('torch', 'torchvision', 'diffusers', 'transformers', "
            "'peft', 'accelerate')}))")


def _versions(python: str) -> dict:
    out = subprocess.run([python, "-c", VERSIONS], check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_install(args) -> list[str]:
    before = _versions(args.python)
    subprocess.run([args.python, "-m", "pip", "install", "-q", "-r", str(PACK / "requirements.txt")], check=True,
                   timeout=1800)
    after = _versions(args.python)
    for name in ("torch", "torchvision"):
        assert before[name] == after[name], f"installing requirements.txt changed {name}: {before[name]} -> " \
                                            f"{after[name]}"
    assert after["diffusers"] and after["transformers"].split(".")[0] == "5", after
    return [f"torch {before['torch']} -> {after['torch']}, torchvision {before['torchvision']} -> "
            f"{after['torchvision']} (unchanged); installed: " + ", ".join(f"{k} {after[k]}" for k in
                                                                           ("diffusers", "transformers", "peft",
                                                                            "accelerate"))]
