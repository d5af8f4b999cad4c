"""The tiny model factory: a real diffusers layout, deterministic, with the templates' real prefix lengths."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.families import templates
from qwen_edit_core.families.qwen_image.tiny import SCHEDULER_CONFIG, prefix_lengths, transformer_config
from qwen_edit_core.model.tiny import SPECIAL_TOKENS, build_tiny


def _digests(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _config(path):
    return json.loads(path.read_text())


def test_same_seed_gives_identical_files(tmp_path, tiny_edit_dir):
    again = build_tiny(tmp_path / "again", variant="edit", seed=0)
    assert _digests(again) == _digests(tiny_edit_dir)
    other = build_tiny(tmp_path / "other", variant="edit", seed=5)
    key = "transformer/diffusion_pytorch_model.safetensors"
    assert _digests(other)[key] != _digests(tiny_edit_dir)[key]


def test_build_leaves_caller_state_alone_and_takes_overrides(tmp_path):
    state, dtype = torch.get_rng_state(), torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = build_tiny(tmp_path / "t", variant="edit-plus", transformer_overrides={"zero_cond_t": True})
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(dtype)
    assert torch.equal(state, torch.get_rng_state())
    assert _config(out / "model_index.json")["_class_name"] == "QwenImageEditPlusPipeline"
    assert _config(out / "transformer/config.json")["zero_cond_t"] is True
    assert _config(out / "text_encoder/config.json")["dtype"] == "float32"
    # A previous build is replaced; a folder that is not one is refused and left as it was.
    assert build_tiny(out) == out and _config(out / "model_index.json")["_class_name"] == "QwenImageEditPipeline"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="model_index.json"):
        build_tiny(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "t"]  # no temporary folders left


def test_prefix_lengths_are_the_pipelines(tiny_edit_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_edit_dir / "tokenizer")
    assert prefix_lengths(tok) == {"edit": 64, "edit-plus": 64, "t2i": 34}
    ids = tok(templates.EDIT_TEMPLATE.format("make it blue"))["input_ids"]
    assert ids[:64] == tok(templates.EDIT_TEMPLATE.split("<|vision_start|>")[0])["input_ids"]
    assert ids[64] == tok.convert_tokens_to_ids("<|vision_start|>")
    plus = tok(templates.EDIT_PLUS_TEMPLATE.format(templates.EDIT_PLUS_IMAGE_PREFIX.format(1) + "x"))["input_ids"]
    assert tok.convert_ids_to_tokens(plus[64]) == "Picture"
    t2i = tok(templates.T2I_TEMPLATE.format("make it blue"))["input_ids"]
    assert tok.convert_ids_to_tokens(t2i[34]) == "make"
    assert tok.decode(tok("any prompt, ünïcode ✓ 日本")["input_ids"]) == "any prompt, ünïcode ✓ 日本"
    # Special tokens sit after the BPE vocabulary in Qwen's order; the encoder config uses the same ids.
    special_ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert special_ids == list(range(len(tok) - len(SPECIAL_TOKENS), len(tok))) and len(tok) < 2048
    encoder = _config(tiny_edit_dir / "text_encoder/config.json")
    assert encoder["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert encoder["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>")
    assert encoder["text_config"]["vocab_size"] == len(tok)


def test_processor_gives_four_image_tokens(tiny_edit_dir):
    from transformers import Qwen2VLProcessor
    processor = Qwen2VLProcessor.from_pretrained(tiny_edit_dir / "processor")
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 64^2 (a tiny image), 1024^2 (Edit's VL area) and 384^2 (Edit Plus's VL area): 2x2 merged patches each.
    for side in (64, 1024, 384):
        inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>x"],
                           images=[Image.new("RGB", (side, side))], return_tensors="pt")
        assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
        assert int((inputs["input_ids"] == pad).sum()) == 4


def test_diffusers_pipelines_load_and_run(tiny_edit_dir, tiny_plus_dir, small_edit_area, monkeypatch):
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module
    monkeypatch.setattr(plus_module, "VAE_IMAGE_SIZE", 128 * 128)  # its hard-coded areas, small as the Edit one's
    monkeypatch.setattr(plus_module, "CONDITION_IMAGE_SIZE", 96 * 96)
    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_dir)
    assert dict(pipe.scheduler.config) | SCHEDULER_CONFIG == dict(pipe.scheduler.config)
    out = pipe(image=Image.new("RGB", (64, 64), "red"), prompt="blue", negative_prompt=" ", true_cfg_scale=2.0,
               num_inference_steps=2, height=64, width=64, output_type="np").images[0]
    assert out.shape == (64, 64, 3) and np.isfinite(out).all()
    plus = QwenImageEditPlusPipeline.from_pretrained(tiny_plus_dir)
    out = plus(image=[Image.new("RGB", (64, 48)), Image.new("RGB", (32, 64))], prompt="x", negative_prompt=" ",
               true_cfg_scale=2.0, num_inference_steps=2, height=64, width=64, output_type="np").images[0]
    assert out.shape == (64, 64, 3) and np.isfinite(out).all()


def test_transformer_configs():
    real = transformer_config("real")
    assert (real["num_layers"], real["num_attention_heads"], real["attention_head_dim"]) == (60, 24, 128)
    assert (real["joint_attention_dim"], tuple(real["axes_dims_rope"])) == (3584, (16, 56, 56))
    assert (real["in_channels"], real["out_channels"], real["patch_size"]) == (64, 16, 2)
    assert transformer_config("real-width") == {**real, "num_layers": 1}
    tiny = transformer_config("tiny", num_layers=3)
    assert (tiny["num_layers"], tiny["num_attention_heads"], tiny["attention_head_dim"]) == (3, 2, 16)
    assert sum(tiny["axes_dims_rope"]) == tiny["attention_head_dim"]
    with pytest.raises(ValueError, match="real-width"):
        transformer_config("huge")


def test_real_width_configs_match_each_other():
    """The real-width build's configs (checked without writing its 1.7 GB: CI disks may be small): the text
    encoder's width is the transformer's joint_attention_dim and its rope sections fit its heads."""
    from qwen_edit_core.families.qwen_image.tiny import _text_config
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    text = _text_config("real-width", 600, ids)["text_config"]
    transformer = transformer_config("real-width")
    assert text["hidden_size"] == transformer["joint_attention_dim"] == 3584
    assert (text["num_hidden_layers"], text["num_attention_heads"], text["num_key_value_heads"]) == (1, 28, 4)
    assert sum(text["rope_parameters"]["mrope_section"]) == 3584 // 28 // 2
