"""The pretrained toy model: committed weights with their documented hashes, a VAE that reconstructs, and a
transformer that does its pretrained edits on pictures it never saw."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen_edit_core.data import synthetic
from qwen_edit_core.model import toy

DOCS = Path(__file__).resolve().parents[2] / "docs" / "TOY_MODEL.md"
#: the PSNRs docs/TOY_MODEL.md states (dB, 128 px held-out pictures)
VAE_PSNR, KEEP_PSNR = 30.5, 22.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two float images in [0, 1]."""
    return float(10 * np.log10(1.0 / np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def _held_out(n: int, size: int = 128):
    rng = np.random.default_rng(12345)  # the build draws from seeds 0-3; these pictures are new
    return [synthetic.picture(rng, size) for _ in range(n)]


def test_committed_weights_match_the_documented_sha256():
    info = toy.check_weights()
    documented = DOCS.read_text()
    for name in toy.FILES:
        digest = toy.sha256(toy.WEIGHTS_DIR / name)
        assert digest == info["sha256"][name]
        assert digest in documented, f"docs/TOY_MODEL.md does not state {name}'s sha256 {digest}"
        assert (toy.WEIGHTS_DIR / name).stat().st_size < 4 * 2**20
    assert re.search(r"qwen-edit tiny --pretrained --train", documented)


def test_a_changed_weights_file_is_refused(tmp_path):
    for name in (*toy.FILES, toy.MANIFEST):
        (tmp_path / name).write_bytes((toy.WEIGHTS_DIR / name).read_bytes())
    data = bytearray((tmp_path / "vae.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "vae.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="vae.safetensors: sha256"):
        toy.check_weights(tmp_path)


@pytest.fixture(scope="module")
def toy_trainer(tmp_path_factory):
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.config import load_config

    model = toy.ensure_toy(tmp_path_factory.mktemp("toy") / "model")
    trainer = QwenImageEditTrainer(load_config(overrides={"model": {"pretrained_model_name_or_path": str(model)},
                                                         "predict": {"vae_area": 128 * 128}}))
    trainer.load_model()
    return trainer


def test_vae_reconstructs_held_out_pictures(toy_trainer):
    from qwen_edit_core.model import encode

    comps = toy_trainer.components
    for picture in _held_out(3):
        latents = toy_trainer.encode_image(picture, area=128 * 128)
        assert latents.shape == (1, 16, 1, 16, 16)
        decoded = encode.postprocess(encode.decode_latents(comps.vae, latents))[0].numpy()
        assert psnr(decoded, np.asarray(picture) / 255.0) > VAE_PSNR


@pytest.mark.parametrize("prompt", list(synthetic.EDITS))
def test_pretrained_edits_on_held_out_pictures(toy_trainer, prompt):
    """"keep the image" reconstructs a held-out picture within KEEP_PSNR dB; every pretrained edit lands
    closer to its own target than to the unedited picture or any other edit."""
    pictures = _held_out(2)
    for picture in pictures:
        out = toy_trainer.predict(picture, prompt, negative_prompt=None, num_inference_steps=20,
                                  true_cfg_scale=1.0, seed=0)
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
    from qwen_edit_core import pretrain

    vae = pretrain.constructed_vae(pretrain.VAE_CONFIG).eval()
    pixels = pretrain._pixels(_held_out(1, size=32))
    constructed = _round_trip(vae, pixels)
    with torch.no_grad():
        pretrain._wake_residuals(vae.decoder, 5)
    assert torch.equal(_round_trip(vae, pixels), constructed)
    encoder = {k: v.clone() for k, v in vae.state_dict().items() if k.startswith(("encoder.", "quant_conv."))}
    pretrain.train_vae_decoder(pretrain.Recipe(size=32, vae_steps=3, vae_batch=1), vae)
    after = vae.state_dict()
    assert all(torch.equal(after[k], v) for k, v in encoder.items())
    assert not torch.equal(_round_trip(vae, pixels), constructed)
