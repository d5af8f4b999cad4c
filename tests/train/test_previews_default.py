"""Previews asked for without a validation picture sample the first training pair's control and caption (logged)
instead of silently doing nothing: the docs' example works as written."""

from __future__ import annotations

import logging

import yaml

from qwen_edit_core.cli import main


def test_previews_without_a_validation_image_sample_the_first_pair(tiny_edit_dir, pairs_dir, tmp_path, caplog):
    path = tmp_path / "c.yaml"
    out = tmp_path / "second"
    path.write_text(yaml.safe_dump({
        "model": {"pretrained_model_name_or_path": str(tiny_edit_dir), "lora": {"rank": 4, "targets": "attn"}},
        "data": {"folder": str(pairs_dir), "vae_area": 4096}, "cache": {"dir": str(tmp_path / "cache")},
        "train": {"output_dir": str(out), "seed": 3}}))
    with caplog.at_level(logging.INFO):
        assert main(["train", str(path), "--max-steps", "2", "--validation-every", "2",
                     "--preview", "diffusers steps=2", "--preview", "lightning steps=1 label=quick"]) == 0
    assert "train.validation_image is not set; the previews sample pair p0's control image(s) with its caption" \
        in caplog.text
    assert (out / "validation" / "step-0000002.png").is_file()
