"""Offline tiny Qwen-Image-2.1: the real classes with random weights, written as a diffusers directory.

`model.tiny.build_tiny(dir, variant="image-2.1")` calls `write` here. The directory holds model_index.json
(`QwenImage21Pipeline`), transformer/ (`QwenImage21Transformer2DModel`), vae/ (`AutoencoderKLQwenImage21`, 64
latent channels, 16x, RGBA), text_encoder/ (`Qwen3VLForConditionalGeneration`), processor/ (`Qwen3VLProcessor`:
a byte-level BPE tokenizer trained on the 2.1 template, Qwen's special tokens, a chat template that renders the
system turn as Qwen3-VL's does, an image processor with Qwen3-VL's 16 px patches merged 2x2) and scheduler/.
`QwenImage21Pipeline.from_pretrained(dir)` loads it offline.

One vision token covers 32x32 pixels (16 px patches, 2x2 merge) and one latent token 16x16 (the VAE's 16x),
so each vision slot of a reference stands for 2x2 latent tokens, as the transformer expects; the image
processor's pixel limits are wide enough that it never resizes an image the pipeline already sized to 32 px.
"""

from __future__ import annotations

import json
from pathlib import Path

from qwen_edit_core.model import tiny

from qwen_edit_core.families import templates, variants
from qwen_edit_core.families import QWEN_IMAGE_21

#: Qwen3-VL's rendering of a conversation (system, user, assistant turns; text and image items), enough for the
#: pipeline's `apply_chat_template` of the system message, which gives the number of tokens it drops.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- elif item['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>{%- endif -%}{%- endfor -%}"
    "{%- endif -%}<|im_end|>\n{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")

#: Qwen-Image-2.1's scheduler as the pipeline reads it: dynamic exponential shift with the pipeline's own
#: calculate_shift defaults (base/max image sequence 256/4096, base/max shift 0.5/1.15), no terminal stretch.
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "invert_sigmas": False, "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000,
    "shift": 1.0, "shift_terminal": None, "stochastic_sampling": False, "time_shift_type": "exponential",
    "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

#: vision tokens of 32x32 pixels (Qwen3-VL: patch 16, merge 2); the pipeline sizes images to multiples of 32
VISION = dict(patch_size=16, merge_size=2, temporal_patch_size=2)


def transformer_config(size: str = "tiny", num_layers: int | None = None) -> dict:
    """QwenImage21Transformer2DModel config: "tiny" (2 layers, 2x16 heads), "real-width" (real widths, one
    block) or "real" (the real 32-block 7 B model, for in-memory benchmarks); `num_layers` replaces the count."""
    if size == "tiny":
        cfg = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, context_in_dim=32, mlp_ratio=3,
                   axes_dims_rope=(4, 6, 6), in_channels=64, out_channels=64, patch_size=1)
    elif size in ("real-width", "real"):
        cfg = dict(num_layers=1 if size == "real-width" else 32, attention_head_dim=128, num_attention_heads=32,
                   context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), in_channels=64, out_channels=64,
                   patch_size=1)
    else:
        raise ValueError(f"unknown size {size!r}; accepted: tiny, real-width, real")
    if num_layers is not None:
        cfg["num_layers"] = num_layers
    return cfg


def _text_config(size: str, vocab_size: int, ids: dict) -> dict:
    # real-width: Qwen3-VL-8B's text widths (hidden 4096, 32 heads of 128, 8 key/value heads) with one layer and a
    # narrow MLP; the vision tower stays tiny (its output width is the text's).
    hidden, heads, kv, layers, inter = (32, 2, 2, 2, 64) if size == "tiny" else (4096, 32, 8, 1, 1024)
    head_dim = hidden // heads
    # mrope_section splits head_dim/2 rotary pairs over (time, height, width) as Qwen3-VL's [24, 20, 20] of 64.
    time_pairs = head_dim // 2 - 2 * (head_dim * 5 // 32)
    mrope = [time_pairs, head_dim * 5 // 32, head_dim * 5 // 32]
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": mrope,
                                 "mrope_interleaved": True},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=VISION["patch_size"], spatial_merge_size=VISION["merge_size"],
                  temporal_patch_size=VISION["temporal_patch_size"], num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    return dict(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def _corpus() -> tuple[str, ...]:
    refs = templates.QWEN21_IMAGE_SEPARATOR.join(templates.QWEN21_IMAGE_PREFIX.format(i) for i in range(1, 11))
    return templates.QWEN21_TEMPLATE, refs, tiny._EXTRA_WORDS


def _processor(out: Path):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = tiny._build_tokenizer(None, _corpus())
    # Pixel limits from one vision token (32x32) to 4096x4096, so the processor keeps every size the pipeline
    # gives it (multiples of 32); Qwen3-VL normalizes with mean = std = 0.5.
    image = Qwen2VLImageProcessor(**VISION, size={"shortest_edge": 32 * 32, "longest_edge": 4096 * 4096},
                                  image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer,
                                 video_processor=Qwen3VLVideoProcessor(**VISION), chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return processor


def write(out: Path, variant: variants.Variant, seed: int, size: str, transformer_overrides: dict) -> None:
    """Write the tiny 2.1 directory's files into `out` (an empty folder; build_tiny renames it into place)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3VLConfig

    family = QWEN_IMAGE_21
    processor = _processor(out / "processor")
    tokenizer = processor.tokenizer
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS}
    FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    with tiny._isolated_init(seed):
        config = Qwen3VLConfig(**_text_config(size, len(tokenizer), ids))
        family.class_of("text_encoder")(config).save_pretrained(out / "text_encoder")
    with tiny._isolated_init(seed):
        # latents_mean/std are made up; distinct per channel so a normalisation bug shows in tests.
        family.class_of("vae")(
            base_dim=16, decoder_base_dim=16, z_dim=family.latent_channels, dim_mult=[1, 2, 2, 4, 4],
            num_res_blocks=1, temperal_downsample=[False, True, True, True],
            latents_mean=[round(-0.3 + 0.01 * i, 4) for i in range(family.latent_channels)],
            latents_std=[round(1.5 + 0.02 * i, 4) for i in range(family.latent_channels)],
        ).save_pretrained(out / "vae")
    with tiny._isolated_init(seed):
        family.class_of("transformer")(**{**transformer_config(size), **transformer_overrides}).save_pretrained(
            out / "transformer")
    index = {"_class_name": variant.pipeline_class, "_diffusers_version": "0.42.1",
             "processor": ["transformers", family.processor_class],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", family.text_encoder_class],
             "transformer": ["diffusers", family.transformer_class],
             "vae": ["diffusers", family.vae_class], "sample_sigmas": None}
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
