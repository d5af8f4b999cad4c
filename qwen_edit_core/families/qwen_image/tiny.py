"""The tiny random 2025 Qwen-Image model directory (`model.tiny.build_tiny` calls this family's `write`): its
transformer's and text encoder's configs (tiny, real-width, and the real transformer for in-memory benchmarks),
its scheduler, and a tokenizer trained on its templates whose prefixes come out at the pipelines' drop counts.
The tokenizer trainer, the special tokens and the seeding are shared with the other families (model/tiny.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from qwen_edit_core.families import templates, variants
from qwen_edit_core.families.variants import Variant
from qwen_edit_core.model import tiny

#: Qwen-Image's scheduler (FlowMatchEulerDiscreteScheduler) config, as shipped with the real model.
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "invert_sigmas": False, "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000,
    "shift": 1.0, "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
    "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

def transformer_config(size: str = "tiny", num_layers: int | None = None) -> dict:
    """The Qwen-Image transformer's config (the default family's `transformer_class`): "tiny" (2 layers, 2x16
    heads), "real-width" (real widths, one block) or "real" (the real 60-block, 20 B-parameter model; build it in
    memory for benchmarks)."""
    if size == "tiny":
        cfg = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    elif size in ("real-width", "real"):
        cfg = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=1 if size == "real-width" else 60,
                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                   axes_dims_rope=(16, 56, 56))
    else:
        raise ValueError(f"unknown size {size!r}; accepted: tiny, real-width, real")
    cfg["guidance_embeds"] = False
    if num_layers is not None:
        cfg["num_layers"] = num_layers
    return cfg


def _text_config(size: str, vocab_size: int, token_ids: dict) -> dict:
    # real-width: the real hidden size (it sets the transformer's joint_attention_dim), heads and key/value
    # heads (28 and 4, as in Qwen2.5-VL-7B) with one layer and a narrow MLP, so the directory stays small;
    # it checks shapes and plumbing, not the 7B encoder's cost.
    hidden, heads, kv_heads, layers, inter = (32, 2, 2, 2, 64) if size == "tiny" else (3584, 28, 4, 1, 1024)
    head_dim = hidden // heads
    # mrope_section splits the head_dim/2 rotary pairs over (time, height, width), 1/4 : 3/8 : 3/8 as in
    # Qwen2.5-VL ([16, 24, 24] for head_dim 128); transformers checks that it sums to head_dim/2.
    time_pairs = head_dim // 8
    space_pairs = head_dim // 2 - time_pairs
    mrope = [time_pairs, space_pairs // 2, space_pairs - space_pairs // 2]
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
                bos_token_id=token_ids["<|endoftext|>"], eos_token_id=token_ids["<|im_end|>"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1])
    return dict(text_config=text, vision_config=vision, image_token_id=token_ids["<|image_pad|>"],
                video_token_id=token_ids["<|video_pad|>"], vision_start_token_id=token_ids["<|vision_start|>"],
                vision_end_token_id=token_ids["<|vision_end|>"], tie_word_embeddings=False)


def corpus() -> tuple[str, ...]:
    """The texts the tiny tokenizer is trained on: the 2025 templates (Edit, Edit Plus with three pictures,
    text-to-image) and the words demo and test prompts use."""
    return (templates.EDIT_TEMPLATE, templates.EDIT_PLUS_TEMPLATE, templates.T2I_TEMPLATE,
            "".join(templates.EDIT_PLUS_IMAGE_PREFIX.format(i) for i in range(1, 4)), tiny._EXTRA_WORDS)


def _prompt_encodings() -> dict[str, tuple[str, str, int]]:
    """{encoding: (dropped prefix text, a formatted prompt, tokens dropped)} of every variant's prompt encoding
    (families/variants.py), plus Qwen-Image's text-to-image template as "t2i"."""
    out = {}
    for variant in variants.VARIANTS.values():
        if variant.drop is None:
            continue  # counted by the processor (Qwen-Image-2.1, families/qwen_image_21/tiny.py)
        text, drop = variant.format_prompt("make it blue", 1)
        out.setdefault(variant.encoding, (variant.template.split("{}")[0].split("<|vision_start|>")[0], text, drop))
    out["t2i"] = (templates.T2I_TEMPLATE.split("{}")[0], templates.T2I_TEMPLATE.format("make it blue"),
                  templates.T2I_DROP)
    return out


def prefix_lengths(tokenizer) -> dict[str, int]:
    """Token counts of the template prefixes that the pipelines drop (must be 64, 64 and 34)."""
    return {name: len(tokenizer(prefix)["input_ids"]) for name, (prefix, _, _) in _prompt_encodings().items()}


def check_prefixes(tokenizer) -> None:
    """Raise unless the pipelines' drop counts cut every template exactly after "<|im_start|>user\n"."""
    encodings = _prompt_encodings()
    got = prefix_lengths(tokenizer)
    want = {name: drop for name, (_, _, drop) in encodings.items()}
    if got != want:
        raise RuntimeError(f"tiny tokenizer splits the template prefixes into {got} tokens, expected {want}")
    # The pipelines drop hidden states of the whole formatted prompt, so check the token right after the cut:
    # it must be the first token of the text after the prefix ("<|vision_start|>", "Picture", "make").
    for name, (prefix, text, drop) in encodings.items():
        expected = tokenizer.convert_ids_to_tokens(tokenizer(text[len(prefix):])["input_ids"][0])
        token = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"][drop])
        if token != expected:
            raise RuntimeError(f"tiny tokenizer: token {drop} of a {name} prompt is {token!r}, expected {expected!r}")


def write(out: Path, variant: Variant, seed: int, size: str, transformer_overrides: dict) -> None:
    """Write the tiny random 2025-family model of `variant` into the empty folder `out` (`build_tiny`'s work)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    tokenizer = tiny._build_tokenizer(out / "tokenizer", corpus(), check=check_prefixes)
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS}
    # Tiny images give 4 merged image tokens (56x56 pixels). The limit sits above 56*56 on purpose:
    # smart_resize floors height/sqrt(h*w/max_pixels)/28, and at exactly 56*56 a square image scaled down
    # lands on 1.999... for some sizes (384x384, Edit Plus's VL area) and gets 1 token instead of 4.
    vision = dict(min_pixels=28 * 28, max_pixels=64 * 64, patch_size=14, merge_size=2, temporal_patch_size=2)
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**vision), tokenizer=tokenizer,
                     video_processor=Qwen2VLVideoProcessor(**vision)).save_pretrained(out / "processor")
    FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG).save_pretrained(out / "scheduler")

    with tiny._isolated_init(seed):
        te_config = Qwen2_5_VLConfig(**_text_config(size, len(tokenizer), token_ids))
        Qwen2_5_VLForConditionalGeneration(te_config).save_pretrained(out / "text_encoder")
    with tiny._isolated_init(seed):
        # latents_mean/std are made up (the real ones are per-channel statistics of the real VAE); distinct
        # values per channel make a normalisation bug (wrong axis, swapped mean/std) visible in tests.
        AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                               temperal_downsample=[False, True, True], dropout=0.0,
                               latents_mean=[round(-0.3 + 0.04 * i, 4) for i in range(16)],
                               latents_std=[round(1.5 + 0.07 * i, 4) for i in range(16)],
                               ).save_pretrained(out / "vae")
    with tiny._isolated_init(seed):
        cfg = {**transformer_config(size), **transformer_overrides}
        QwenImageTransformer2DModel(**cfg).save_pretrained(out / "transformer")

    index = {"_class_name": variant.pipeline_class, "_diffusers_version": "0.42.1",
             "processor": ["transformers", "Qwen2VLProcessor"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
             "tokenizer": ["transformers", "Qwen2Tokenizer"],
             "transformer": ["diffusers", "QwenImageTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKLQwenImage"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
