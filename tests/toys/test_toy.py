"""The pretrained toys, the Qwen-Image-Edit toy and the toy Qwen-Image-2.1, each checked the same way: committed
weights with their documented hashes (a changed file refused), a VAE that reconstructs, and a transformer that
does its pretrained edits on pictures it never saw (the 2.1 toy with the picture as reference 1). Then the 2025
toy's decoder training; the 2.1 toy's own checks are in test_toy21.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen_edit_core.data import synthetic
from qwen_edit_core.families import QWEN_IMAGE_21
from qwen_edit_core.toys import toy

DOCS = Path(__file__).resolve().parents[2] / "docs" / "TOY_MODEL.md"
#: the PSNR docs/TOY_MODEL.md states for "keep the image" (dB, 128 px held-out pictures), both toys
KEEP_PSNR = 22.0


@dataclass(frozen=True)
class Toy:
    """What differs between the two toys' common checks."""

    weights: Path
    command: str  #: the build command docs/TOY_MODEL.md and the manifest give
    max_mib: int  #: each weights file is smaller
    vae_psnr: float  #: the VAE round trip's PSNR docs/TOY_MODEL.md states (dB, 128 px held-out pictures)
    latents: tuple  #: a 128 px picture's latents
    channels: int  #: the decoded picture's (2.1: RGBA, alpha 1)


TOYS = [pytest.param(Toy(toy.WEIGHTS_DIR, "qwen-edit tiny --pretrained --train", 4, 30.5, (1, 16, 1, 16, 16), 3),
                     id="edit"),
        pytest.param(Toy(toy.weights_of(QWEN_IMAGE_21), "qwen-edit tiny --variant image-2.1 --pretrained --train", 8, 27.5,
                         (1, 64, 1, 8, 8), 4), id="image-2.1")]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two float images in [0, 1]."""
    return float(10 * np.log10(1.0 / np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def _held_out(n: int, size: int = 128):
    rng = np.random.default_rng(12345)  # the builds draw from seeds 0-4; these pictures are new
    return [synthetic.picture(rng, size) for _ in range(n)]


@pytest.mark.parametrize("case", TOYS)
def test_committed_weights_match_the_documented_sha256(case):
    info = toy.check_weights(case.weights)
    documented = DOCS.read_text()
    for name in toy.FILES:
        digest = toy.sha256(case.weights / name)
        assert digest == info["sha256"][name]
        assert digest in documented, f"docs/TOY_MODEL.md does not state {name}'s sha256 {digest}"
        assert (case.weights / name).stat().st_size < case.max_mib * 2**20
    assert case.command in documented and info["command"].startswith(case.command)


@pytest.mark.parametrize("case", TOYS)
def test_a_changed_weights_file_is_refused(case, tmp_path):
    for name in (*toy.FILES, toy.MANIFEST):
        (tmp_path / name).write_bytes((case.weights / name).read_bytes())
    data = bytearray((tmp_path / "vae.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "vae.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="vae.safetensors: sha256"):
        toy.check_weights(tmp_path)


@pytest.fixture(scope="module", params=TOYS)
def toy_model(request, tmp_path_factory):
    """(the toy's Toy, a trainer with the toy loaded), one toy at a time."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.config import load_config

    case = request.param
    model = toy.ensure_toy(tmp_path_factory.mktemp("toy") / "model", case.weights)
    trainer = QwenImageEditTrainer(load_config(overrides={"model": {"pretrained_model_name_or_path": str(model)},
                                                         "predict": {"vae_area": 128 * 128}}))
    trainer.load_model()
    return case, trainer


def test_vae_reconstructs_held_out_pictures(toy_model):
    from qwen_edit_core.model import encode

    case, trainer = toy_model
    for picture in _held_out(3):
        latents = trainer.encode_image(picture, area=128 * 128)
        assert latents.shape == case.latents
        decoded = encode.postprocess(encode.decode_latents(trainer.components.vae, latents))[0].numpy()
        assert decoded.shape == (128, 128, case.channels) and np.all(decoded[..., 3:] == 1.0)
        assert psnr(decoded[..., :3], np.asarray(picture) / 255.0) > case.vae_psnr


@pytest.mark.parametrize("prompt", list(synthetic.EDITS))
def test_pretrained_edits_on_held_out_pictures(toy_model, prompt):
    """"keep the image" reconstructs a held-out picture (the 2.1 toy's reference 1) within KEEP_PSNR dB; every
    pretrained edit lands closer to its own target than to the unedited picture or any other edit."""
    _, trainer = toy_model
    for picture in _held_out(2):
        out = trainer.predict(picture, prompt, negative_prompt=None, num_inference_steps=20,
                              true_cfg_scale=1.0, seed=0)[..., :3]
        targets = {p: np.asarray(f(picture)) / 255.0 for p, f in synthetic.EDITS.items()}
        scores = {p: psnr(out, t) for p, t in targets.items()}
        assert max(scores, key=scores.get) == prompt, scores
        if prompt == "keep the image":
            assert scores[prompt] > KEEP_PSNR, scores


@torch.no_grad()
def _round_trip(vae, pixels):
    return vae.decode(vae.encode(pixels).latent_dist.mode(), return_dict=False)[0]


def test_decoder_training_keeps_the_encoder_and_starts_at_the_constructed_output():
    """The VAE step trains only the decoder: the encoder (so the latents the transformer learned on) is
    unchanged, and waking the residual branches leaves the constructed decoder's output exactly as it was."""
    from qwen_edit_core.families.qwen_image import pretrain as pretrain25
    from qwen_edit_core.toys import pretrain

    vae = pretrain25.constructed_vae(pretrain25.VAE_CONFIG).eval()
    pixels = pretrain.vae_input(_held_out(1, size=32))
    constructed = _round_trip(vae, pixels)
    with torch.no_grad():
        pretrain25._wake_residuals(vae.decoder, 5)
    assert torch.equal(_round_trip(vae, pixels), constructed)
    encoder = {k: v.clone() for k, v in vae.state_dict().items() if k.startswith(("encoder.", "quant_conv."))}
    pretrain25.train_vae_decoder(pretrain.Recipe(size=32, vae_steps=3, vae_batch=1), vae)
    after = vae.state_dict()
    assert all(torch.equal(after[k], v) for k, v in encoder.items())
    assert not torch.equal(_round_trip(vae, pixels), constructed)
