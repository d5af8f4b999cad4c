"""The toy Qwen-Image-2.1's own checks: its manifest names its family, its constructed VAE's latents are the
pictures' 4x4-pixel square colours, and the build machinery writes a 2.1 model. The checks both toys share
(hashes, the VAE's reconstruction, the pretrained edits) are test_toy.py's, run on both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import KEEPS_THE_LUMINANCE
from qwen_edit_core.data import synthetic
from qwen_edit_core.families import QWEN_IMAGE_21
from qwen_edit_core.toys import toy



def test_the_manifest_names_the_2_1_family():
    assert toy.check_weights(toy.weights_of(QWEN_IMAGE_21))["variant"] == "image-2.1"


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


def test_the_dct_basis_and_constant_latents():
    """`Recipe.latent_basis` "dct" gives the square colours through the orthonormal `latent_basis`, and
    `Recipe.constant_latents` channels after them hold 1 (left unnormalized by make_vae); the 2025 toy refuses both."""
    from qwen_edit_core.families.qwen_image import pretrain as pretrain25
    from qwen_edit_core.families.qwen_image_21 import pretrain as pretrain21
    from qwen_edit_core.toys.pretrain import Recipe

    basis = pretrain21.latent_basis("dct")
    assert torch.allclose(basis @ basis.T, torch.eye(48), atol=1e-5)
    pixels = pretrain21._pixels([synthetic.picture(np.random.default_rng(12345), 128)])
    with torch.no_grad():
        squares = pretrain21.constructed_vae().encode(pixels).latent_dist.mode()[0, :48, 0]
        z = pretrain21.constructed_vae(constant_latents=16, basis="dct").encode(pixels).latent_dist.mode()[0, :, 0]
    expected = torch.einsum("kc,chw->khw", basis, squares)
    assert (z[:48] - expected).abs().max() < 0.02 * expected.abs().max()  # SiLU's curvature, larger on the DC terms
    assert torch.allclose(z[48:], torch.ones_like(z[48:]), atol=1e-3)
    with pytest.raises(ValueError, match="latent_basis='haar'"):
        pretrain21.latent_basis("haar")
    with pytest.raises(ValueError, match="constant_latents=16"):
        pretrain25.make_vae(Recipe(constant_latents=16))


def test_a_short_build_writes_weights_that_load_as_a_2_1_model(tmp_path):
    """The build machinery for the 2.1 family end to end on a tiny recipe, its second phase run alone
    (`pretrain_references`, which refuses weights that are not its first phase's): the manifest names the family,
    its command and the whole recipe, and `build_toy` turns the files into a Qwen-Image-2.1 directory with the
    fitted VAE."""
    import dataclasses
    import json

    from qwen_edit_core.toys.pretrain import Recipe, pretrain, pretrain_references

    recipe = Recipe(variant="image-2.1", pictures=1, transformer_steps=1, transformer_batch=2, reference_steps=1)
    first = pretrain(tmp_path / "weights", dataclasses.replace(recipe, reference_steps=0))
    info = pretrain_references(tmp_path / "weights", recipe)
    assert info["variant"] == "image-2.1" and info["recipe"]["reference_steps"] == 1
    assert info["sha256"]["vae.safetensors"] == first["sha256"]["vae.safetensors"]
    assert info["sha256"]["transformer.safetensors"] != first["sha256"]["transformer.safetensors"]
    assert info["command"] == "qwen-edit tiny --variant image-2.1 --pretrained --train --weights-dir WEIGHTS_DIR OUT_DIR"
    with pytest.raises(ValueError, match="not the first phase"):
        pretrain_references(tmp_path / "weights", recipe)
    model = toy.build_toy(tmp_path / "model", tmp_path / "weights")
    index = json.loads((model / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline" and index["vae"][1] == "AutoencoderKLQwenImage21"
    vae_config = json.loads((model / "vae" / "config.json").read_text())
    assert vae_config["patch_size"] == 16 and vae_config["z_dim"] == 64


@pytest.mark.parametrize("variant", ["edit", "image-2.1"])
def test_the_sample_workflows_grayscale_edit_keeps_reference_1s_light_and_dark(variant, tmp_path):
    """As the sample workflow runs it ("make it grayscale", 20 steps, CFG 1; the 2.1 workflow with reference 1 a
    picture and reference 2 its colour inversion), the grey picture shows reference 1's light and dark: its
    luminance correlates with the grayscale target's by KEEPS_THE_LUMINANCE, on held-out pictures, for both toys.

    Why not the demo's edge similarity: a grey target's edges are faint (shapes of different hues but close
    luminance vanish), so the 2025 toy itself stays under KEEPS_THE_SHAPES there, while a person sees the picture's
    light and dark kept; the luminance correlation measures that, and a grey blank or a blend with reference 2 fails
    it (BENCHMARKS.md, "Toy model builds")."""
    from PIL import ImageOps

    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.config import load_config
    from qwen_edit_core.demo import luminance_correlation
    from qwen_edit_core.families import variants
    from qwen_edit_core.families.qwen_image_21 import sampler as sampler21
    from qwen_edit_core.sample import sampler

    family = variants.get(variant).family
    model = toy.ensure_toy(tmp_path / "toy", toy.weights_of(family))
    trainer = QwenImageEditTrainer(load_config(overrides={"model": {"pretrained_model_name_or_path": str(model)},
                                                         "predict": {"vae_area": 128 * 128}}))
    trainer.load_model()
    settings = sampler.SampleSettings(num_inference_steps=20, true_cfg_scale=1.0, negative_prompt=None, seed=0,
                                      vae_area=128 * 128)
    rng = np.random.default_rng(12345)  # the builds draw from seeds 0-4; these pictures are new
    for picture in [synthetic.picture(rng, 128) for _ in range(3)]:
        if family is QWEN_IMAGE_21:
            references = [picture, ImageOps.invert(picture.convert("RGB"))]
            cond = sampler21.build_conditioning(trainer.components, "make it grayscale", references, settings)
            latents = sampler21.denoise(trainer.components, cond, settings)
            image = sampler21.decode(trainer.components, latents, cond.width, cond.height)[0][..., :3].numpy()
        else:
            image = trainer.predict(picture, "make it grayscale", negative_prompt=None, num_inference_steps=20,
                                    true_cfg_scale=1.0, seed=0)[..., :3]
        target = np.asarray(synthetic.EDITS["make it grayscale"](picture), dtype=np.float32) / 255.0
        assert luminance_correlation(image, target) >= KEEPS_THE_LUMINANCE


def test_extra_references_follow_the_edited_picture(tmp_path):
    """With `extra_references` every pair gets one or two more references after the picture it edits: reference 1's
    tokens and the target are those of the one-reference build (the pictures' draws do not move), the slots and
    tokens count every reference, and a mixed batch trains with the trainer's loss."""
    import json

    from transformers import AutoProcessor

    from qwen_edit_core.config import load_config
    from qwen_edit_core.families import QWEN_IMAGE_21
    from qwen_edit_core.families.qwen_image_21 import pretrain as pretrain21
    from qwen_edit_core.model.tiny import build_tiny
    from qwen_edit_core.toys.pretrain import Recipe
    from qwen_edit_core.train.batch import flow_loss, sample_generator

    tiny = build_tiny(tmp_path / "tiny", variant="image-2.1", seed=0)
    text_encoder = QWEN_IMAGE_21.class_of("text_encoder").from_pretrained(tiny / "text_encoder").eval()
    processor = AutoProcessor.from_pretrained(tiny / "processor")
    vae = pretrain21.constructed_vae().eval()
    prompts, functions = ["make it grayscale"], [synthetic.EDITS["make it grayscale"]]

    def items(share):
        recipe = Recipe(variant="image-2.1", pictures=3, extra_references=share)
        return pretrain21.edit_dataset(recipe, vae, text_encoder, processor, prompts, functions)

    one, more = items(0.0), items(1.0)
    assert [it["references"] for it in one] == [1, 1, 1]
    assert all(it["references"] in (2, 3) for it in more)
    for a, b in zip(one, more):
        assert torch.equal(a["reference"], b["reference"][:64]) and torch.equal(a["target"], b["target"])
        assert b["reference"].shape == (64 * b["references"], 64)
        assert int(b["slots"].sum()) == 16 * b["references"]  # one slot per 2x2 tokens of each reference
    scheduler = json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())
    transformer = QWEN_IMAGE_21.class_of("transformer")(**pretrain21.transformer_settings(Recipe(variant="image-2.1")))
    batch = pretrain21.batch(more, 8, [sample_generator(0, 0, 0, i) for i in range(len(more))])
    loss, _ = flow_loss(transformer, batch, load_config(), scheduler)
    assert torch.isfinite(loss)
    from qwen_edit_core.families.qwen_image import pretrain as pretrain25
    with pytest.raises(ValueError, match="extra_references=0.5"):
        pretrain25.edit_dataset(Recipe(extra_references=0.5), None, None, None, prompts, functions)


@pytest.mark.parametrize("count", [-1, 17, 64, 81])
def test_constant_latents_outside_the_spare_channels_are_refused(count):
    """Only latent channels 48-63 are spare: more would write into conv_out's logvar half (or past it), fewer than
    none would silently be none."""
    from qwen_edit_core.families.qwen_image_21 import pretrain as pretrain21

    with pytest.raises(ValueError, match=rf"Recipe\(constant_latents={count}\): accepted 0 to 16"):
        pretrain21.constructed_vae(constant_latents=count)
