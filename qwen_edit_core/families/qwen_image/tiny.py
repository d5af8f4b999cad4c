"""The tiny random 2025 Qwen-Image model directory (`model.tiny.build_tiny` calls this family's `write`); the
tokenizer, the text encoder's and transformer's tiny configs and the seeding are model/tiny.py's."""

from __future__ import annotations

import json
from pathlib import Path

from qwen_edit_core.families.variants import Variant
from qwen_edit_core.model import tiny
from qwen_edit_core.model.tiny import SCHEDULER_CONFIG  # noqa: F401 - the tiny models' scheduler


def write(out: Path, variant: Variant, seed: int, size: str, transformer_overrides: dict) -> None:
    """Write the tiny random 2025-family model of `variant` into the empty folder `out` (`build_tiny`'s work)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    tokenizer = tiny._build_tokenizer(out / "tokenizer")
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS}
    # Tiny images give 4 merged image tokens (56x56 pixels). The limit sits above 56*56 on purpose:
    # smart_resize floors height/sqrt(h*w/max_pixels)/28, and at exactly 56*56 a square image scaled down
    # lands on 1.999... for some sizes (384x384, Edit Plus's VL area) and gets 1 token instead of 4.
    vision = dict(min_pixels=28 * 28, max_pixels=64 * 64, patch_size=14, merge_size=2, temporal_patch_size=2)
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**vision), tokenizer=tokenizer,
                     video_processor=Qwen2VLVideoProcessor(**vision)).save_pretrained(out / "processor")
    FlowMatchEulerDiscreteScheduler.from_config(tiny.SCHEDULER_CONFIG).save_pretrained(out / "scheduler")

    with tiny._isolated_init(seed):
        te_config = Qwen2_5_VLConfig(**tiny._text_config(size, len(tokenizer), token_ids))
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
        cfg = {**tiny.transformer_config(size), **transformer_overrides}
        QwenImageTransformer2DModel(**cfg).save_pretrained(out / "transformer")

    index = {"_class_name": variant.pipeline_class, "_diffusers_version": "0.42.1",
             "processor": ["transformers", "Qwen2VLProcessor"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
             "tokenizer": ["transformers", "Qwen2Tokenizer"],
             "transformer": ["diffusers", "QwenImageTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKLQwenImage"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
