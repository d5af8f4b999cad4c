"""The toy Qwen-Image-2.1's own checks: its manifest names its family, its constructed VAE's latents are the
pictures' 4x4-pixel square colours, and the build machinery writes a 2.1 model. The checks both toys share
(hashes, the VAE's reconstruction, the pretrained edits) are test_toy.py's, run on both."""

from __future__ import annotations

import numpy as np
import torch

from qwen_edit_core.data import synthetic
from qwen_edit_core.toys import toy


def test_the_manifest_names_the_2_1_family():
    assert toy.check_weights(toy.WEIGHTS_DIR_21)["variant"] == "image-2.1"


def test_constructed_encoder_gives_the_square_colours():
    """Latent channels 0-47 of the constructed encoder are the mean RGB of each 16 px cell's sixteen 4x4-pixel
    squares (up to SiLU's curvature), 48-63 are zero: the latents the transformer learns on."""
    from qwen_edit_core.families.qwen_image_21 import pretrain as pretrain21

    vae = pretrain21.constructed_vae().eval()
    pixels = pretrain21._pixels([synthetic.picture(np.random.default_rng(12345), 128)])  # a held-out picture
    with torch.no_grad():
        z = vae.encode(pixels).latent_dist.mode()[0, :, 0]  # (64, 8, 8)
    squares = pixels[0, :3, 0].reshape(3, 8, 4, 4, 8, 4, 4).mean(dim=(3, 6))  # (c, Y, sy, X, sx)
    expected = squares.permute(2, 4, 0, 1, 3).reshape(48, 8, 8)  # channel 3 * (4 sy + sx) + c
    assert torch.allclose(z[:48], expected, atol=5e-3, rtol=1e-2)
    assert torch.all(z[48:] == 0)


def test_a_short_build_writes_weights_that_load_as_a_2_1_model(tmp_path):
    """The build machinery for the 2.1 family end to end on a tiny recipe: the manifest names the family and
    its command, and `build_toy` turns the files into a Qwen-Image-2.1 directory with the fitted VAE."""
    import json

    from qwen_edit_core.toys.pretrain import Recipe, pretrain

    info = pretrain(tmp_path / "weights", Recipe(variant="image-2.1", pictures=4, transformer_steps=2,
                                                 transformer_batch=2))
    assert info["variant"] == "image-2.1" and info["recipe"]["variant"] == "image-2.1"
    assert info["command"] == "qwen-edit tiny --variant image-2.1 --pretrained --train --weights-dir WEIGHTS_DIR OUT_DIR"
    model = toy.build_toy(tmp_path / "model", tmp_path / "weights")
    index = json.loads((model / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline" and index["vae"][1] == "AutoencoderKLQwenImage21"
    vae_config = json.loads((model / "vae" / "config.json").read_text())
    assert vae_config["patch_size"] == 16 and vae_config["z_dim"] == 64
