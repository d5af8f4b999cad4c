"""The pretrained toy Qwen-Image-Edit: the tiny architecture with trained VAE and transformer weights.

The weights ship with the package, one folder per family named after it (`weights_of`: `weights/<Family.name>/`):
`vae.safetensors`, `transformer.safetensors` and `toy.json` with both configs, the build command, seed, variant and
the files' sha256. `build_toy(dir)` writes a complete diffusers-layout directory: the random tiny model of
`tiny.build_tiny` (tokenizer, processor, scheduler and the random tiny text encoder, seed 0) with the trained VAE
and transformer in place of the random ones. The classes are diffusers' own, so every code path is the real one.

The weights come from `qwen-edit tiny --pretrained` (qwen_edit_core/toys/pretrain.py); see docs/TOY_MODEL.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from qwen_edit_core.families import DEFAULT

log = logging.getLogger(__name__)

WEIGHTS_ROOT = Path(__file__).resolve().parent / "weights"


def weights_of(family) -> Path:
    """The folder of `family`'s shipped toy weights (its `Family.name` under WEIGHTS_ROOT)."""
    return WEIGHTS_ROOT / family.name


#: the default family's toy weights (the 2025 toy Qwen-Image-Edit)
WEIGHTS_DIR = weights_of(DEFAULT)
MANIFEST = "toy.json"
FILES = ("vae.safetensors", "transformer.safetensors")


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest(weights_dir: Path = WEIGHTS_DIR) -> dict:
    """The toy model's manifest: configs, build command, seed, sha256 of each weights file."""
    path = Path(weights_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: build the toy weights with `qwen-edit tiny --pretrained "
                                f"--weights-dir {weights_dir}`")
    return json.loads(path.read_text())


def check_weights(weights_dir: Path = WEIGHTS_DIR) -> dict:
    """Raise unless every weights file matches the manifest's sha256; returns the manifest."""
    info = manifest(weights_dir)
    for name in FILES:
        got = sha256(Path(weights_dir) / name)
        if got != info["sha256"][name]:
            raise ValueError(f"{Path(weights_dir) / name}: sha256 {got} differs from {MANIFEST}'s "
                             f"{info['sha256'][name]}; rebuild with `{info['command']}`")
    return info


def build_toy(out_dir, weights_dir: Path = WEIGHTS_DIR) -> Path:
    """Write the toy model directory (diffusers layout, Edit variant) to `out_dir`; returns its path.

    The directory is assembled beside `out_dir` and renamed into place; an existing `out_dir` is replaced
    only if it is empty or holds a previous model (as `build_tiny`).
    """
    from safetensors.torch import load_file

    from qwen_edit_core.families import variants
    from qwen_edit_core.model.tiny import _check_replaceable, _isolated_init, build_tiny

    info = check_weights(weights_dir)
    variant = variants.get(info.get("variant", variants.DEFAULT))
    out = Path(out_dir)
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.toy-", dir=out.parent))
    try:
        model = build_tiny(work / "model", variant=variant.name, seed=info["text_encoder_seed"])
        for name in ("vae", "transformer"):
            with _isolated_init(0):
                module = variant.family.class_of(name)(**info[f"{name}_config"])
            module.load_state_dict(load_file(str(Path(weights_dir) / f"{name}.safetensors")))
            shutil.rmtree(model / name)
            module.save_pretrained(model / name)
        if out.exists():
            shutil.rmtree(out)
        model.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("built the toy model in %s", out)
    return out


def ensure_toy(out_dir, weights_dir: Path = WEIGHTS_DIR) -> Path:
    """`out_dir` holding the toy model of `weights_dir` (a family's, `weights_of(family)`): built when missing or
    built from other weights (checked by the manifest's sha256 recorded in `out_dir/toy.json`)."""
    out = Path(out_dir)
    info = manifest(weights_dir)
    stamp = out / MANIFEST
    if (out / "model_index.json").is_file() and stamp.is_file() and \
            json.loads(stamp.read_text()).get("sha256") == info["sha256"]:
        return out
    build_toy(out, weights_dir)
    stamp.write_text(json.dumps({"sha256": info["sha256"]}, indent=1) + "\n")
    return out
