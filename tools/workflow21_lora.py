"""Which picture and how many steps the Qwen-Image-2.1 training workflow needs to keep its shapes: its job (one pair:
the demo dataset's first picture of `--seed` as reference 1, its inversion as reference 2, the target reference 1
with reference 2's left half pasted on its right half; rank 32, alpha 16, lr 1e-2, batch 1, 128 px) trained through
the core, then its references sampled through the LoRA (20 steps, CFG 1, seed 0) as the workflow samples them. One
JSON line: the edge similarity per half (`demo.edge_similarity` of each half to the target's) of the picture before
and after the LoRA, and of the target's own VAE round trip (what the toy can show at best).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python tools/workflow21_lora.py OUT --seed 3 --steps 300
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python tools/workflow21_lora.py OUT --seed 0 --steps 300 \\
        --targets all,modulation.1,norm_out.linear
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from qwen_edit_core import demo

#: the workflow's caption (workflows/build_workflows.py EDIT21)
CAPTION = "paste the second picture's left half onto the first picture's right half"
SIZE = 128


def _halves(picture: np.ndarray, target: np.ndarray) -> list[float]:
    half = SIZE // 2
    return [round(demo.edge_similarity(picture[:, :half, :3], target[:, :half]), 2),
            round(demo.edge_similarity(picture[:, half:, :3], target[:, half:]), 2)]


def run(out: Path, seed: int, steps: int, targets: str, rank: int = 32, alpha: float = 16.0, lr: float = 1e-2) -> dict:
    """The workflow's job on the picture of `seed` into `out` (its LoRA settings unless given); the scores."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.config import load_config
    from qwen_edit_core.families import variants
    from qwen_edit_core.toys import toy

    family = variants.get("image-2.1").family
    model = toy.ensure_toy(out / family.toy.demo_folder, toy.weights_of(family))
    (control_path, _), *_ = demo.write_dataset(out / "demo", 1, seed=seed)
    control = Image.open(control_path).convert("RGB")
    inverted = ImageOps.invert(control)
    target = control.copy()
    target.paste(inverted.crop((0, 0, SIZE // 2, SIZE)), (SIZE // 2, 0))
    pairs = out / "pairs"
    pairs.mkdir(parents=True, exist_ok=True)
    control.save(pairs / "pair_00001_control_1.png")
    inverted.save(pairs / "pair_00001_control_2.png")
    target.save(pairs / "pair_00001.png")
    (pairs / "pair_00001.txt").write_text(CAPTION)
    config = load_config(overrides={
        "model": {"pretrained_model_name_or_path": str(model),
                  "lora": {"rank": rank, "alpha": alpha, "targets": targets if "," not in targets else targets.split(",")}},
        "data": {"folder": str(pairs), "vae_area": SIZE * SIZE, "batch_size": 1},
        "cache": {"dir": str(out / "cache")},
        "train": {"output_dir": str(out / "train"), "max_steps": steps, "seed": 0, "checkpoint_every": steps,
                  "lora_name": "workflow21"},
        "optimizer": {"lr": lr}, "predict": {"true_cfg_scale": 1.0, "vae_area": SIZE * SIZE}})
    trainer = QwenImageEditTrainer(config)
    trainer.load_model()
    wanted = np.asarray(target, dtype=np.float64) / 255.0

    def sampled() -> list[float]:
        picture = trainer.predict([control, inverted], CAPTION, negative_prompt=None, num_inference_steps=20,
                                  true_cfg_scale=1.0, seed=0)
        return _halves(picture, wanted)

    sampler = family.stage("sampler")
    round_trip = sampler.decode(trainer.components, sampler.pack(trainer.encode_image(target, area=SIZE * SIZE)),
                                SIZE, SIZE)[0].numpy()
    before = sampled()
    trainer.cache()
    trainer.fit()
    trainer.load_model(which=("vae", "text_encoder"), keep_transformer=True)
    return {"seed": seed, "steps": steps, "targets": targets, "rank": rank, "alpha": alpha, "lr": lr,
            "vae_round_trip": _halves(round_trip, wanted),
            "before": before, "after": sampled()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a folder for the toy model, the pair and the LoRA")
    parser.add_argument("--seed", type=int, default=3, help="the demo dataset's seed (the workflow's: 3)")
    parser.add_argument("--steps", type=int, default=300, help="LoRA steps (the workflow's: 300)")
    parser.add_argument("--targets", default="all", help="a preset or comma-separated module-name suffixes")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (the workflow's: 32)")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (the workflow's: 16)")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate (the workflow's: 1e-2)")
    args = parser.parse_args()
    started = time.process_time()
    with demo.one_thread():
        result = run(args.out, args.seed, args.steps, args.targets, args.rank, args.alpha, args.lr)
    print(json.dumps({**result, "cpu_s": round(time.process_time() - started)}))


if __name__ == "__main__":
    main()
