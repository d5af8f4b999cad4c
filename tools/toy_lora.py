"""Which layers a toy's LoRA needs: the demo's job (`qwen-edit demo`: "invert the colors", its 24 pairs, rank 64, lr
1e-2) on a toy with the LoRA on the given module-name suffixes (or a preset), and the held-out pictures' edge
similarity (`demo.edge_similarity`) and pixel MSE to the targets before and after. One JSON line.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python tools/toy_lora.py OUT --variant image-2.1 --targets all
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python tools/toy_lora.py OUT --variant image-2.1 \\
        --targets to_q,to_k,to_v,to_out.0,img_mlp.proj,img_mlp.gate_layer,img_mlp.out,modulation.1,norm_out.linear
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from qwen_edit_core import demo
from qwen_edit_core.families import variants


def run(out: Path, variant: str, targets: str, steps: int) -> dict:
    """The demo's job into `out` with the LoRA on `targets`; the scores before and after."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.toys import toy

    family = variants.get(variant).family
    model = toy.ensure_toy(out / family.toy.demo_folder, toy.weights_of(family))
    demo.write_dataset(out / "dataset", demo.N_TRAIN, seed=0)
    held_out = demo.write_dataset(out / "held_out", demo.N_HELD_OUT, seed=1)
    config = demo._config(model, out / "dataset", out, steps)
    lora = dataclasses.replace(config.model.lora, targets=targets if "," not in targets else targets.split(","))
    trainer = QwenImageEditTrainer(dataclasses.replace(config, model=dataclasses.replace(config.model, lora=lora)))
    trainer.load_model()
    before = demo._evaluate(trainer, held_out)
    trainer.cache()
    trainer.fit()
    trainer.load_model(which=("vae", "text_encoder"), keep_transformer=True)
    after = demo._evaluate(trainer, held_out)
    return {"targets": targets, "steps": steps, "edge_similarity_before": round(before["edge_similarity"], 3),
            "edge_similarity_after": round(after["edge_similarity"], 3), "pixel_mse_before": round(before["pixel_mse"], 4),
            "pixel_mse_after": round(after["pixel_mse"], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a folder for the toy model, the pairs and the LoRA")
    parser.add_argument("--variant", default=variants.DEFAULT, help="the toy's variant (edit or image-2.1)")
    parser.add_argument("--targets", default="all", help="a preset or comma-separated module-name suffixes")
    parser.add_argument("--steps", type=int, default=demo.STEPS, help="LoRA steps (default: the demo's)")
    args = parser.parse_args()
    started = time.process_time()
    with demo.one_thread():
        result = run(args.out, args.variant, args.targets, args.steps)
    print(json.dumps({**result, "cpu_s": round(time.process_time() - started)}))


if __name__ == "__main__":
    main()
