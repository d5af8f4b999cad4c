"""The variant registry: lookup, detection from a model directory or a single file, and every stage reading it."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import torch

from qwen_edit_core.families import templates, variants


def _model_dir(tmp_path, pipeline_class, transformer_config=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline_class}))
    if transformer_config is not None:
        (tmp_path / "transformer").mkdir()
        (tmp_path / "transformer" / "config.json").write_text(json.dumps(transformer_config))
    return tmp_path


def test_lookup_describes_each_release():
    edit, plus, z = variants.get("edit"), variants.get("edit-plus"), variants.get("edit-2511")
    assert (edit.pipeline_class, edit.max_controls, edit.vl_own_area, edit.zero_cond_t) == (
        "QwenImageEditPipeline", 1, False, False)
    assert (plus.pipeline_class, plus.max_controls, plus.vl_own_area, plus.zero_cond_t) == (
        "QwenImageEditPlusPipeline", 3, True, False)
    assert (z.pipeline_class, z.max_controls, z.vl_own_area, z.zero_cond_t) == (
        "QwenImageEditPlusPipeline", 3, True, True)
    assert (edit.drop, plus.drop, z.drop) == (64, 64, 64)
    # 2511 prompts and encodes exactly as 2509, so both share cache entries
    assert z.encoding == plus.encoding == "edit-plus" and edit.encoding == "edit"
    assert variants.NAMES == ("edit", "edit-plus", "edit-2511", "image-2.1") and variants.DEFAULT == "edit"
    with pytest.raises(dataclasses.FrozenInstanceError):
        edit.drop = 3



def test_unknown_name_names_the_accepted_ones():
    with pytest.raises(variants.UnknownVariantError, match="unknown variant 'edit-9999'; accepted: edit, "
                                                           "edit-plus, edit-2511"):
        variants.get("edit-9999")
    assert issubclass(variants.UnknownVariantError, ValueError)


def test_prompts_are_the_pipelines_templates():
    assert variants.get("edit").format_prompt("make it blue", 1) == (
        templates.EDIT_TEMPLATE.format("make it blue"), templates.EDIT_DROP)
    two = templates.EDIT_PLUS_IMAGE_PREFIX.format(1) + templates.EDIT_PLUS_IMAGE_PREFIX.format(2)
    for name in ("edit-plus", "edit-2511"):
        assert variants.get(name).format_prompt("p", 2) == (templates.EDIT_PLUS_TEMPLATE.format(two + "p"), 64)
        assert variants.get(name).format_prompt("p", 0) == (templates.EDIT_PLUS_TEMPLATE.format("p"), 64)
    with pytest.raises(ValueError, match="variant 'edit' takes exactly one control image, got 2; use variant "
                                         "'edit-plus' or 'edit-2511' for several"):
        variants.get("edit").format_prompt("p", 2)
    with pytest.raises(ValueError, match="variant 'edit-plus' takes at most 3 control images, got 4; give at most 3"):
        variants.get("edit-plus").format_prompt("p", 4)


def test_image_areas():
    assert variants.get("edit").vl_area(1024 * 1024, 384 * 384) == 1024 * 1024
    assert variants.get("edit-plus").vl_area(1024 * 1024, 384 * 384) == 384 * 384
    assert variants.get("edit").vl_area_key(384 * 384) == 0
    assert variants.get("edit-2511").vl_area_key(384 * 384) == 384 * 384


@pytest.mark.parametrize("pipeline,transformer,expected", [
    ("QwenImageEditPipeline", None, "edit"),
    ("QwenImageEditPlusPipeline", None, "edit-plus"),
    ("QwenImageEditPlusPipeline", {"num_layers": 2}, "edit-plus"),
    ("QwenImageEditPlusPipeline", {"zero_cond_t": False}, "edit-plus"),
    ("QwenImageEditPlusPipeline", {"zero_cond_t": True}, "edit-2511"),
])
def test_detection_from_a_model_directory(tmp_path, pipeline, transformer, expected):
    from qwen_edit_core.model.components import detect_variant
    model_dir = _model_dir(tmp_path / "m", pipeline, transformer)
    assert variants.from_model_dir(model_dir).name == expected
    assert detect_variant(model_dir) == expected


def test_detection_refuses_other_pipelines(tmp_path):
    from qwen_edit_core.model.components import ModelNotFoundError, detect_variant
    model_dir = _model_dir(tmp_path / "t2i", "QwenImagePipeline")
    with pytest.raises(variants.UnknownVariantError, match="QwenImagePipeline model; accepted: "
                                                           "QwenImageEditPipeline, QwenImageEditPlusPipeline"):
        variants.from_model_dir(model_dir)
    with pytest.raises(ModelNotFoundError, match="t2i.*QwenImagePipeline"):
        detect_variant(model_dir)


def test_detection_from_a_single_file(tmp_path):
    from safetensors.torch import save_file

    from qwen_edit_core.model import single_file
    assert variants.zero_cond_t_in_file(["img_in.weight", variants.ZERO_COND_MARKER])
    assert not variants.zero_cond_t_in_file(["img_in.weight"])
    path = tmp_path / "t.safetensors"
    save_file({"model.diffusion_model.__index_timestep_zero__": torch.empty(0),
               "model.diffusion_model.img_in.weight": torch.zeros(2, 2)}, str(path))
    tensors, flags = single_file.read_state_dict(path)
    assert flags["zero_cond_t"] is True and list(tensors) == ["img_in.weight"]


def test_config_and_cli_accept_the_registry_names():
    from qwen_edit_core import load_config
    from qwen_edit_core.cli import build_parser
    from qwen_edit_core.config import ConfigError, ModelConfig
    hint = typing.get_type_hints(ModelConfig)["variant"]
    assert typing.get_args(hint) == ("", *variants.NAMES)
    assert load_config(overrides={"model": {"variant": "edit-2511"}}).model.variant == "edit-2511"
    with pytest.raises(ConfigError, match="model.variant: 'edit-9' is not accepted; accepted: , edit, edit-plus"):
        load_config(overrides={"model": {"variant": "edit-9"}})
    parser = build_parser()
    assert parser.parse_args(["tiny", "out", "--variant", "edit-2511"]).variant == "edit-2511"
    assert parser.parse_args(["tiny", "out"]).variant == variants.DEFAULT
    with pytest.raises(SystemExit):
        parser.parse_args(["tiny", "out", "--variant", "edit-9"])


def test_2511_shares_the_cache_key_of_2509(tmp_path):
    from PIL import Image

    from qwen_edit_core.data.dataset import EditExample
    from qwen_edit_core.data.example_tensors import EncodeSettings, cache_key
    for name in ("t.png", "c.png"):
        Image.new("RGB", (64, 48), (10, 20, 30)).save(tmp_path / name)
    example = EditExample(name="a", target=tmp_path / "t.png", controls=(tmp_path / "c.png",), caption="x",
                          target_size=(64, 48), control_sizes=((64, 48),))
    keys = {name: cache_key(example, EncodeSettings(variant=name, vae_area=64 * 64, vl_area=32 * 32,
                                                   dtype=torch.float32), "id")
            for name in variants.NAMES if variants.get(name).drop is not None}
    assert keys["edit-2511"] == keys["edit-plus"] != keys["edit"]
    assert (keys["edit"].template, keys["edit"].vl_area, keys["edit-plus"].vl_area) == ("edit", 0, 32 * 32)


def test_tiny_2511_model_is_detected(tmp_path):
    from qwen_edit_core.model.components import detect_variant
    from qwen_edit_core.model.tiny import build_tiny
    out = build_tiny(tmp_path / "z", variant="edit-2511")
    assert json.loads((out / "transformer" / "config.json").read_text())["zero_cond_t"] is True
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "QwenImageEditPlusPipeline"
    assert detect_variant(out) == "edit-2511"
