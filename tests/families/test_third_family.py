"""A third model family is one description plus its stage modules: a stand-in family, the 2025 family's
behaviour under another name (its own transformer class, variant, pipeline class and cache name), registered
at run time, runs the cache stage, one training step and one sampling step through the stages, which find it
from the model, the directory and the cache entry, and give the 2025 family's numbers."""

from __future__ import annotations

import dataclasses
import json
import shutil

import diffusers
import pytest
import torch
from PIL import Image

from qwen_edit_core import families
from qwen_edit_core.families import variants

SIDE = 64


class StandInTransformer2DModel(diffusers.QwenImageTransformer2DModel):
    """The stand-in family's transformer class: the 2025 one under another name."""


STAND_IN = dataclasses.replace(families.QWEN_IMAGE, name="stand-in", title="Stand-in (a test family)",
                               transformer_class="StandInTransformer2DModel", cache_name="stand-in",
                               file_title="Stand-in")
VARIANT = dataclasses.replace(variants.EDIT, name="stand-in-edit", title="Stand-in Edit",
                              pipeline_class="StandInEditPipeline", encoding="stand-in-edit", family=STAND_IN)


@pytest.fixture
def stand_in(tiny_edit_dir, tmp_path, monkeypatch):
    """The stand-in family and variant registered, and a model directory of it (the tiny 2025 model's weights
    under the stand-in's pipeline and transformer class names)."""
    monkeypatch.setattr(diffusers, "StandInTransformer2DModel", StandInTransformer2DModel, raising=False)
    monkeypatch.setitem(variants.VARIANTS, VARIANT.name, VARIANT)
    families.register(STAND_IN)
    model_dir = tmp_path / "stand-in"
    shutil.copytree(tiny_edit_dir, model_dir)
    for name, key, value in (("model_index.json", "_class_name", VARIANT.pipeline_class),
                             ("transformer/config.json", "_class_name", STAND_IN.transformer_class)):
        data = json.loads((model_dir / name).read_text())
        (model_dir / name).write_text(json.dumps({**data, key: value}))
    yield model_dir
    families.unregister(STAND_IN)


def _components(model_dir):
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    return load_components(model_dir, DevicePlan.from_mapping({}), which=("transformer", "vae", "text_encoder"))


def _example(folder):
    from qwen_edit_core.data.dataset import EditExample
    folder.mkdir()
    control, target = folder / "control.png", folder / "target.png"
    picture = Image.effect_noise((SIDE, SIDE), 60).convert("RGB")
    picture.save(control)
    Image.eval(picture, lambda v: 255 - v).save(target)
    return EditExample("pair", target, (control,), "invert the colors", (SIDE, SIDE), ((SIDE, SIDE),))


def _run_stages(model_dir, example, cache_dir):
    """(cache key, cache entry, the training step's loss and LoRA gradient norm, a sampled picture) of
    `model_dir`'s family, each stage finding the family itself."""
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.config import load_config
    from qwen_edit_core.data.cache import EmbeddingCache
    from qwen_edit_core.data.example_tensors import EncodeSettings, build_cache, cache_key, encoder_identity
    from qwen_edit_core.sample import sampler
    from qwen_edit_core.train.batch import collate, flow_loss, sample_generator

    comps = _components(model_dir)
    family = families.family_of(comps.transformer)
    settings = EncodeSettings(variant=comps.variant, vae_area=SIDE * SIDE, vl_area=SIDE * SIDE, dtype=torch.float32)
    identity = encoder_identity(model_dir)
    cache = EmbeddingCache(cache_dir)
    build_cache(comps, [example], cache, settings, identity=identity)
    key = cache_key(example, settings, identity)
    entry = cache.get(key)
    torch.manual_seed(0)  # the LoRA's initial A
    lora.inject_lora(comps.transformer, lora.LoraSpec(rank=2, targets=family.lora_targets["attn"]))
    batch = collate([entry], [sample_generator(0, 0, 0, 0)], caption_dropout=0.0, control_dropout=0.0,
                    device=torch.device("cpu"), dtype=torch.float32, family=families.family_of(key))
    loss, _ = flow_loss(comps.transformer, batch, load_config(), comps.scheduler_config)
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in comps.transformer.parameters() if p.grad is not None]).norm()
    picture = sampler.sample(comps, "invert the colors", [Image.open(example.controls[0])],
                             sampler.SampleSettings(num_inference_steps=1, true_cfg_scale=1.0, seed=0,
                                                    vae_area=SIDE * SIDE))
    return family, key, entry, batch.family, loss.detach(), grad, picture


def test_a_registered_stand_in_family_runs_cache_training_and_sampling(stand_in, tiny_edit_dir, tmp_path):
    example = _example(tmp_path / "data")
    family, key, entry, batch_family, loss, grad, picture = _run_stages(stand_in, example, tmp_path / "cache")
    assert family is STAND_IN and families.family_of(stand_in) is STAND_IN
    assert key.family == "stand-in" and families.family_of(key) is STAND_IN and batch_family is STAND_IN
    assert torch.isfinite(loss) and grad > 0 and picture.shape == (1, SIDE, SIDE, 3)

    # the same stages on the 2025 family's directory: the same numbers, and entries kept apart by family
    theirs = _run_stages(tiny_edit_dir, example, tmp_path / "cache")
    assert theirs[0] is families.QWEN_IMAGE and theirs[1].digest() != key.digest()
    assert set(theirs[2]) == set(entry) and all(torch.equal(theirs[2][k], entry[k]) for k in entry)
    assert torch.equal(theirs[4], loss) and torch.equal(theirs[5], grad) and torch.equal(theirs[6], picture)


def test_register_refuses_a_family_whose_names_are_taken():
    with pytest.raises(ValueError, match="already belong to 'qwen-image'"):
        families.register(dataclasses.replace(families.QWEN_IMAGE, name="other"))
    with pytest.raises(ValueError, match="ships with the package"):
        families.unregister(families.QWEN_IMAGE_21)
