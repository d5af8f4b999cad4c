"""The tiny model factory: a real diffusers layout, deterministic, with the templates' real prefix lengths."""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from PIL import Image

from qwen_edit_core import templates
from qwen_edit_core.tiny import SCHEDULER_CONFIG, build_tiny, prefix_lengths, transformer_config


def _digests(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_identical_files(tmp_path, tiny_edit_dir):
    again = build_tiny(tmp_path / "again", variant="edit", seed=0)
    assert _digests(again) == _digests(tiny_edit_dir)
    other = build_tiny(tmp_path / "other", variant="edit", seed=5)
    key = "transformer/diffusion_pytorch_model.safetensors"
    assert _digests(other)[key] != _digests(tiny_edit_dir)[key]


def test_global_rng_untouched(tmp_path):
    state = torch.get_rng_state()
    build_tiny(tmp_path / "t")
    assert torch.equal(state, torch.get_rng_state())


def test_prefix_lengths_are_the_pipelines(tiny_edit_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_edit_dir / "tokenizer")
    assert prefix_lengths(tok) == {"edit": 64, "edit-plus": 64, "t2i": 34}
    ids = tok(templates.EDIT_TEMPLATE.format("make it blue"))["input_ids"]
    assert ids[64] == tok.convert_tokens_to_ids("<|vision_start|>")
    plus = tok(templates.EDIT_PLUS_TEMPLATE.format(templates.EDIT_PLUS_IMAGE_PREFIX.format(1) + "x"))["input_ids"]
    assert tok.convert_ids_to_tokens(plus[64]) == "Picture"
    assert tok.decode(tok("any prompt, ünïcode ✓")["input_ids"]) == "any prompt, ünïcode ✓"


def test_diffusers_pipelines_load_and_run(tiny_edit_dir, tiny_plus_dir):
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_dir)
    assert pipe.scheduler.config["max_shift"] == 0.9 and pipe.scheduler.config["shift_terminal"] == 0.02
    out = pipe(image=Image.new("RGB", (64, 64), "red"), prompt="blue", negative_prompt=" ", true_cfg_scale=2.0,
               num_inference_steps=2, height=64, width=64, output_type="np").images[0]
    assert np.isfinite(out).all()
    plus = QwenImageEditPlusPipeline.from_pretrained(tiny_plus_dir)
    out = plus(image=[Image.new("RGB", (64, 48)), Image.new("RGB", (32, 64))], prompt="x", negative_prompt=" ",
               true_cfg_scale=2.0, num_inference_steps=2, height=64, width=64, output_type="np").images[0]
    assert np.isfinite(out).all()


def test_scheduler_and_shapes():
    assert SCHEDULER_CONFIG["base_image_seq_len"] == 256 and SCHEDULER_CONFIG["max_image_seq_len"] == 8192
    real = transformer_config("real")
    assert (real["num_layers"], real["num_attention_heads"], real["attention_head_dim"]) == (60, 24, 128)
    assert transformer_config("real-width")["num_layers"] == 1
    assert transformer_config("tiny", num_layers=3)["num_layers"] == 3
