"""Pixel-aligned pairs: controls resized to the target's size in training (`data.control_size: target`) and to
the output size in sampling (`predict.control_size: target`), the output at the control's own size when it is
a multiple of 16, and no shift between the kept control and the decoded output (a "keep the image" model on
the tiny model's VAE and token layout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.model import encode
from qwen_edit_core.sample import sampler

from tolerances import TINY_VAE_ROUNDINGS, assert_close_fp32


class KeepTheImage(torch.nn.Module):
    """A "keep the image" model on the tiny model's token layout: it predicts the exact velocity towards the
    first control image's tokens at the same positions, so sampling ends at the control's latents wherever the
    control and the output share a token grid."""

    def __init__(self):
        super().__init__()
        self.img_in = torch.nn.Linear(64, 4)
        self.config = type("Config", (), {"in_channels": 64})()

    def forward(self, hidden_states, timestep, img_shapes, return_dict=False, **_):
        f, h, w = img_shapes[0][0]
        n = f * h * w
        x, control = hidden_states[:, :n], hidden_states[:, n:2 * n]
        return ((x - control) / timestep.reshape(-1, 1, 1),)


def _blob_image(w, h):
    """A dark image with one bright off-centre square and a gradient: a single clear correlation peak."""
    arr = np.zeros((h, w, 3), np.uint8)
    arr[..., 2] = np.linspace(0, 80, w, dtype=np.uint8)[None]
    arr[h // 4: h // 4 + 16, w // 5: w // 5 + 16] = 255
    return Image.fromarray(arr)


def _peak_offset(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(dy, dx) of the circular cross-correlation peak of two greyscale images of one size (0, 0: aligned)."""
    a, b = a - a.mean(), b - b.mean()
    corr = np.fft.ifft2(np.fft.fft2(a) * np.conj(np.fft.fft2(b))).real
    dy, dx = np.unravel_index(np.argmax(corr), corr.shape)
    h, w = corr.shape
    return (dy if dy <= h // 2 else dy - h), (dx if dx <= w // 2 else dx - w)


@pytest.fixture(scope="module")
def components(tiny_edit_dir):
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    comps = load_components(tiny_edit_dir, DevicePlan.from_mapping({"text_encoder": "cpu", "vae": "cpu",
                                                                     "transformer": "cpu"}),
                            which=("vae", "text_encoder", "transformer"))
    comps.transformer = KeepTheImage()
    return comps


@pytest.mark.parametrize("mode, size, expected", [("pipeline", (64, 64), (64, 64)), ("target", (96, 64), (96, 64)),
                                                  ("pipeline", (96, 64), (64, 64)),
                                                  ("target", (100, 70), (64, 64))])
def test_output_size_and_zero_offset(components, mode, size, expected):
    control = _blob_image(*size)
    settings = sampler.SampleSettings(num_inference_steps=4, true_cfg_scale=1.0, negative_prompt=None, seed=0,
                                      vae_area=64 * 64, control_size=mode)
    out = sampler.sample(components, "keep the image", [control], settings)[0].numpy()
    assert (out.shape[1], out.shape[0]) == expected
    # "Keep the image" through the tiny (random) VAE: the control at the output size, encoded and decoded.
    vae = components.vae
    pixels = encode.pixels_for_vae(encode.resize(control, *expected), *expected)
    kept = encode.postprocess(encode.decode_latents(vae, encode.encode_latents(vae, pixels)))[0].numpy()
    assert _peak_offset(out.mean(-1), kept.mean(-1)) == (0, 0)
    # the Euler steps land on the control's latents up to their rounding (a difference, a quotient, a product and
    # a sum per step), which the decoder carries into the picture with its own
    assert_close_fp32(torch.from_numpy(out), torch.from_numpy(kept), ops=TINY_VAE_ROUNDINGS + 4 * 4,
                      what=f"kept picture, {mode} {size}")
    if mode == "target" and size[0] % 16 == 0 and size[1] % 16 == 0:
        assert expected == size  # the control's own size: no rescale


def test_target_mode_caches_controls_at_the_targets_size(tiny_edit_dir, tmp_path):
    from conftest import train_config
    from qwen_edit_core import QwenImageEditTrainer
    from qwen_edit_core.data.example_tensors import buckets, cache_key, encoder_identity
    folder = tmp_path / "d"
    folder.mkdir()
    _blob_image(96, 64).save(folder / "a.png")
    _blob_image(64, 96).save(folder / "a_control.png")
    (folder / "a.txt").write_text("keep it")
    entries = {}
    for mode in ("pipeline", "target"):
        trainer = QwenImageEditTrainer(train_config(tiny_edit_dir, folder, tmp_path / mode,
                                                    cache_dir=tmp_path / "cache",
                                                    data={"control_size": mode, "vae_area": 96 * 96}))
        (example,) = trainer.dataset().examples
        settings = trainer.encode_settings("edit")
        trainer.cache([example])
        entries[mode] = trainer._cache().get(cache_key(example, settings, encoder_identity(tiny_edit_dir)))
        target_bucket, control_buckets = buckets(example, settings)
        assert (control_buckets == (target_bucket,)) == (mode == "target")
    assert entries["target"]["img_shapes"][1].tolist() == entries["target"]["img_shapes"][0].tolist()
    assert entries["pipeline"]["img_shapes"][1].tolist() != entries["pipeline"]["img_shapes"][0].tolist()
    assert torch.equal(entries["target"]["target_latents"], entries["pipeline"]["target_latents"])


def test_cli_flags_set_both_control_sizes():
    from qwen_edit_core.cli import build_parser, train_overrides
    args = build_parser().parse_args(["train", "c.yaml", "--control-size", "target"])
    assert train_overrides(args) == {"data": {"control_size": "target"}}
    args = build_parser().parse_args(["sample", "--model", "m", "--image", "i.png", "--prompt", "p", "--out", "o.png",
                                      "--control-size", "target"])
    assert args.control_size == "target"
