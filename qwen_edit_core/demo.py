"""The main job on the embedded tiny model (`make demo`): build the tiny model and run an edit.

Everything is offline: the model is built from nothing with random weights, so the image is noise-like; the
job proves the whole path runs and writes its files.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)


def run_demo(out_dir: Path) -> dict:
    """Build (or reuse) the tiny model under `out_dir`, sample one edit, write `edit.png`; return paths."""
    from .config import load_config
    from .facade import QwenImageEditTrainer
    from .tiny import build_tiny

    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = out_dir / "tiny-model"
    if not (model_dir / "model_index.json").is_file():
        build_tiny(model_dir)
    control = Image.fromarray(np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8))
    control.save(out_dir / "control.png")
    config = load_config(overrides={"model": {"pretrained_model_name_or_path": str(model_dir)},
                                    "predict": {"vae_area": 256 * 256}})
    trainer = QwenImageEditTrainer(config)
    trainer.load_model()
    trainer.setup_predict()
    edited = trainer.predict(control, "make the sky purple", negative_prompt=" ", num_inference_steps=8, seed=0,
                             output_type="pil")
    edited.save(out_dir / "edit.png")
    log.info("demo: wrote %s and %s", out_dir / "control.png", out_dir / "edit.png")
    return {"model": model_dir, "edit": out_dir / "edit.png"}
