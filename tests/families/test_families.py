"""Model families: both the 2025 Qwen-Image family and Qwen-Image-2.1 are described, and the tiny 2.1 model is the
real architecture that diffusers' own pipeline loads offline."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from qwen_edit_core.families import variants
from qwen_edit_core import families


def test_every_variant_has_its_family():
    assert {v.name: v.family.name for v in variants.VARIANTS.values()} == {
        "edit": "qwen-image", "edit-plus": "qwen-image", "edit-2511": "qwen-image", "image-2.1": "qwen-image-2.1"}
    old, new = families.QWEN_IMAGE, families.QWEN_IMAGE_21
    assert (old.latent_channels, old.vae_scale, old.patch, old.token_pixels) == (16, 8, 2, 16)
    assert (new.latent_channels, new.vae_scale, new.patch, new.token_pixels) == (64, 16, 1, 16)
    assert (new.max_references, new.prefix_cache, new.alpha, new.cfg_rescale) == (10, True, True, False)
    assert "Research" in new.licence and old.licence == "Apache-2.0"


def test_2025_lora_presets_are_unchanged():
    from qwen_edit_core.adapters.lora import TARGET_PRESETS
    attn = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    assert TARGET_PRESETS == {"attn": attn, "attn-img": ("to_q", "to_k", "to_v", "to_out.0"),
                              "all": attn + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                             "txt_mlp.net.2")}


def test_tiny_21_loads_in_diffusers_pipeline_offline(tiny_21_dir):
    from diffusers import QwenImage21Pipeline
    from qwen_edit_core.families.qwen_image_21.encode import system_tokens
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_dir)
    family = variants.IMAGE_21.family
    for component in ("transformer", "vae", "text_encoder", "processor"):
        assert type(getattr(pipe, component)) is family.class_of(component)
    assert pipe.vae.config.z_dim == pipe.transformer.config.in_channels == family.latent_channels
    assert (pipe.vae.config.in_channels, pipe.vae.config.out_channels) == (4, 4)  # RGBA
    assert system_tokens(pipe.processor) == pipe._drop_idx
    assert json.loads((tiny_21_dir / "model_index.json").read_text())["_class_name"] == "QwenImage21Pipeline"


def test_21_prompt_is_the_pipelines(tiny_21_dir):
    from diffusers import QwenImage21Pipeline
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_dir)
    assert variants.IMAGE_21.format_prompt("p", 0)[0] == pipe.prompt_template_t2i.format("p")
    first = "<image1><|vision_start|><|image_pad|><|vision_end|>"
    three = first + "".join(f" <image{i}><|vision_start|><|image_pad|><|vision_end|>" for i in (2, 3))
    assert variants.IMAGE_21.format_prompt("p", 3)[0] == pipe.prompt_template_ti2i.replace(first, three).format("p")
    with pytest.raises(ValueError, match="at most 10"):
        variants.IMAGE_21.format_prompt("p", 11)


def test_21_detection_lora_targets_and_blocks(tiny_21_dir, caplog):
    from qwen_edit_core.model.components import detect_variant, load_components
    from qwen_edit_core.model.devices import DevicePlan
    assert detect_variant(tiny_21_dir) == "image-2.1"
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.model.components"):
        comps = load_components(tiny_21_dir, DevicePlan.from_mapping({}), which=("transformer",))
    assert sum("Qwen Research License" in r.getMessage() for r in caplog.records) == 1
    family = variants.get(comps.variant).family
    blocks = getattr(comps.transformer, family.blocks)
    assert len(blocks) == comps.transformer.config.num_layers
    names = {n for n, m in blocks.named_modules() if isinstance(m, torch.nn.Linear)}
    for preset, suffixes in family.lora_targets.items():
        for suffix in suffixes:
            assert any(n.endswith(suffix) for n in names), (preset, suffix)


def test_a_21_model_encodes_for_training_under_its_family(tiny_21_dir):
    from qwen_edit_core import load_config
    from qwen_edit_core.families import QWEN_IMAGE_21
    from qwen_edit_core.train.run import encode_settings
    settings = encode_settings(load_config(), "image-2.1")
    assert settings.family is QWEN_IMAGE_21 and settings.prefix_len == 0


def test_convrot_files_are_refused_with_what_to_use(tmp_path):
    import json as _json

    from safetensors.torch import save_file

    from qwen_edit_core.model.planned_load import load_transformer_file
    from qwen_edit_core.model.single_file import SingleFileError
    note = torch.tensor(list(_json.dumps({"format": "int8_convrot"}).encode()), dtype=torch.uint8)
    save_file({"txt_in.text_norm.weight": torch.zeros(4), "img_in.weight": torch.zeros(4, 4, dtype=torch.int8),
               "img_in.comfy_quant": note}, tmp_path / "convrot.safetensors")
    with pytest.raises(SingleFileError, match="quantized as 'int8_convrot'.*bf16 file.*diffusers directory"):
        load_transformer_file(tmp_path / "convrot.safetensors", device=torch.device("cpu"), dtype=torch.float32)


def test_family_of_answers_for_each_kind_of_thing(tiny_edit_dir, tiny_21_dir):
    """One question, one function: a model directory, a transformer file's keys, a cache key, a cache entry's
    tensors and a stage module all lead to the same family."""
    from qwen_edit_core.data.cache import CacheKey
    from qwen_edit_core.families import QWEN_IMAGE, QWEN_IMAGE_21, family_of
    assert family_of(tiny_edit_dir) is QWEN_IMAGE and family_of(tiny_21_dir) is QWEN_IMAGE_21
    assert family_of(["model.diffusion_model.txt_in.text_norm.weight"]) is QWEN_IMAGE_21
    assert family_of(["img_in.weight"]) is QWEN_IMAGE
    key = CacheKey(image_hashes=("0" * 64,), caption="c", component_identity="i", vae_area=64, vl_area=0,
                   target_bucket=(64, 64), control_buckets=(), template="t", prefix_len=0, dtype="float32",
                   family=QWEN_IMAGE_21.cache_name)
    assert family_of(key) is QWEN_IMAGE_21
    entry = {"prompt_embeds": torch.zeros(2, 4), **{name: torch.ones(2, dtype=torch.bool)
                                                     for name in QWEN_IMAGE_21.cache_tensors}}
    assert family_of(entry) is QWEN_IMAGE_21 and family_of({"prompt_embeds": torch.zeros(2, 4)}) is QWEN_IMAGE
    # a VAE file's header, a diffusers config, a LoRA's and a validation file's metadata
    from qwen_edit_core.model.file_stream import read_header
    for model_dir, family in ((tiny_edit_dir, QWEN_IMAGE), (tiny_21_dir, QWEN_IMAGE_21)):
        assert family_of(read_header(model_dir / "vae" / "diffusion_pytorch_model.safetensors")) is family
        assert family_of(read_header(model_dir / "transformer" / "diffusion_pytorch_model.safetensors")) is family
    assert family_of({"_class_name": QWEN_IMAGE_21.transformer_class, "num_layers": 2}) is QWEN_IMAGE_21
    assert family_of({"format": "comfyui-lora", "architecture": QWEN_IMAGE_21.name}) is QWEN_IMAGE_21
    assert family_of({"labels": "[]", "family": QWEN_IMAGE_21.cache_name}) is QWEN_IMAGE_21
    assert family_of({"labels": "[]"}) is QWEN_IMAGE
    with pytest.raises(KeyError, match="'a-future-family'"):
        family_of({"architecture": "a-future-family"})
    with pytest.raises(families.MissingStage, match=r"has no 'nowhere' stage module: add "
                                                    r"qwen_edit_core\.families\.qwen_image\.nowhere") as missing:
        QWEN_IMAGE.stage("nowhere")
    assert isinstance(missing.value, LookupError)
