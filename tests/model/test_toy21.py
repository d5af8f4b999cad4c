"""The pretrained toy Qwen-Image-2.1: committed weights with their documented hashes, a constructed VAE whose
latents are the pictures' 4x4-pixel square colours and whose fitted decoder reconstructs them, and a transformer
that does its pretrained edits of reference 1 on pictures it never saw."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen_edit_core.data import synthetic
from qwen_edit_core.model import toy

DOCS = Path(__file__).resolve().parents[2] / "docs" / "TOY_MODEL.md"
#: the PSNRs docs/TOY_MODEL.md states for the toy 2.1 (dB, 128 px held-out pictures)
VAE_PSNR, KEEP_PSNR = 27.5, 22.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two float images in [0, 1]."""
    return float(10 * np.log10(1.0 / np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def _held_out(n: int, size: int = 128):
    rng = np.random.default_rng(12345)  # the build draws from seeds 0-4; these pictures are new
    return [synthetic.picture(rng, size) for _ in range(n)]


def test_committed_weights_match_the_documented_sha256():
    info = toy.check_weights(toy.WEIGHTS_DIR_21)
    assert info["variant"] == "image-2.1"
    documented = DOCS.read_text()
    for name in toy.FILES:
        digest = toy.sha256(toy.WEIGHTS_DIR_21 / name)
        assert digest == info["sha256"][name]
        assert digest in documented, f"docs/TOY_MODEL.md does not state {name}'s sha256 {digest}"
        assert (toy.WEIGHTS_DIR_21 / name).stat().st_size < 8 * 2**20
    assert re.search(r"qwen-edit tiny --variant image-2.1 --pretrained --train", documented)
    assert info["command"].startswith("qwen-edit tiny --variant image-2.1 --pretrained --train")


def test_constructed_encoder_gives_the_square_colours():
    """Latent channels 0-47 of the constructed encoder are the mean RGB of each 16 px cell's sixteen 4x4-pixel
    squares (up to SiLU's curvature), 48-63 are zero: the latents the transformer learns on."""
    from qwen_edit_core import pretrain21

    vae = pretrain21.constructed_vae().eval()
    pixels = pretrain21._pixels(_held_out(1))
    with torch.no_grad():
        z = vae.encode(pixels).latent_dist.mode()[0, :, 0]  # (64, 8, 8)
    squares = pixels[0, :3, 0].reshape(3, 8, 4, 4, 8, 4, 4).mean(dim=(3, 6))  # (c, Y, sy, X, sx)
    expected = squares.permute(2, 4, 0, 1, 3).reshape(48, 8, 8)  # channel 3 * (4 sy + sx) + c
    assert torch.allclose(z[:48], expected, atol=5e-3, rtol=1e-2)
    assert torch.all(z[48:] == 0)


@pytest.fixture(scope="module")
def toy21_trainer(tmp_path_factory):
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.config import load_config

    model = toy.ensure_toy(tmp_path_factory.mktemp("toy21") / "model", toy.WEIGHTS_DIR_21)
    trainer = QwenImageEditTrainer(load_config(overrides={"model": {"pretrained_model_name_or_path": str(model)},
                                                         "predict": {"vae_area": 128 * 128}}))
    trainer.load_model()
    return trainer


def test_vae_reconstructs_held_out_pictures(toy21_trainer):
    from qwen_edit_core.model import encode

    comps = toy21_trainer.components
    for picture in _held_out(3):
        latents = toy21_trainer.encode_image(picture, area=128 * 128)
        assert latents.shape == (1, 64, 1, 8, 8)
        decoded = encode.postprocess(encode.decode_latents(comps.vae, latents))[0].numpy()
        assert decoded.shape == (128, 128, 4) and np.all(decoded[..., 3] == 1.0)
        assert psnr(decoded[..., :3], np.asarray(picture) / 255.0) > VAE_PSNR


@pytest.mark.parametrize("prompt", list(synthetic.EDITS))
def test_pretrained_edits_of_reference_1_on_held_out_pictures(toy21_trainer, prompt):
    """With the picture as reference 1, "keep the image" reconstructs it within KEEP_PSNR dB; every pretrained
    edit lands closer to its own target than to any other edit's."""
    for picture in _held_out(2):
        out = toy21_trainer.predict(picture, prompt, negative_prompt=None, num_inference_steps=20,
                                    true_cfg_scale=1.0, seed=0)[..., :3]
        targets = {p: np.asarray(f(picture)) / 255.0 for p, f in synthetic.EDITS.items()}
        scores = {p: psnr(out, t) for p, t in targets.items()}
        assert max(scores, key=scores.get) == prompt, scores
        if prompt == "keep the image":
            assert scores[prompt] > KEEP_PSNR, scores


def test_a_short_build_writes_weights_that_load_as_a_2_1_model(tmp_path):
    """The build machinery for the 2.1 family end to end on a tiny recipe: the manifest names the family and
    its command, and `build_toy` turns the files into a Qwen-Image-2.1 directory with the fitted VAE."""
    import json

    from qwen_edit_core.pretrain import Recipe, pretrain

    info = pretrain(tmp_path / "weights", Recipe(variant="image-2.1", pictures=4, transformer_steps=2,
                                                 transformer_batch=2))
    assert info["variant"] == "image-2.1" and info["recipe"]["variant"] == "image-2.1"
    assert info["command"] == "qwen-edit tiny --variant image-2.1 --pretrained --train --weights-dir WEIGHTS_DIR OUT_DIR"
    model = toy.build_toy(tmp_path / "model", tmp_path / "weights")
    index = json.loads((model / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline" and index["vae"][1] == "AutoencoderKLQwenImage21"
    vae_config = json.loads((model / "vae" / "config.json").read_text())
    assert vae_config["patch_size"] == 16 and vae_config["z_dim"] == 64
