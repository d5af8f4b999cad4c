"""The text encoder as one file in ComfyUI's text_encoders layout (bf16/fp32 and scaled fp8), the tokenizer from
ComfyUI's bundled qwen25_tokenizer folder, and their errors. Files are written from the tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from qwen_edit_core.families.qwen_image import encode
from qwen_edit_core.sample import sampler
from qwen_edit_core.model.components import (ModelNotFoundError, load_components, load_processor, load_text_encoder,
                                       processor_source, resolve_model_file)
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.model.single_file import SingleFileError
from qwen_edit_core.families.qwen_image.text_encoder_file import load_text_encoder_file

from conftest import scaled_fp8

CPU = torch.device("cpu")
PROMPTS = ["make the sky purple", ""]


def comfy_te_state(model_dir, dtype=torch.float32, lm_head=True, prefix=""):
    """The tiny text encoder with ComfyUI's key names (comfy/text_encoders/llama.py Qwen25_7BVLI: `model.*` for
    the language model, `visual.*` for the vision tower; transformers 5 nests both under `model.`)."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir / "text_encoder", dtype=dtype)
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model."):]
        elif key.startswith("model.visual."):
            key = "visual." + key[len("model.visual."):]
        elif key == "lm_head.weight" and not lm_head:
            continue
        out[prefix + key] = value.clone().contiguous()
    return out


def fake_comfyui(model_dir, root):
    """A folder laid out like a ComfyUI installation's comfy/text_encoders/qwen25_tokenizer/, holding the tiny
    tokenizer in the same three files and form as ComfyUI's (vocab.json without the special tokens, merges.txt,
    tokenizer_config.json declaring the special tokens in added_tokens_decoder)."""
    folder = root / "comfy" / "text_encoders" / "qwen25_tokenizer"
    folder.mkdir(parents=True)
    data = json.loads((model_dir / "tokenizer" / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab = {k: v for k, v in data["model"]["vocab"].items() if k not in special}
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    config = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "model_max_length": 131072,
              "clean_up_tokenization_spaces": False, "split_special_tokens": False,
              "tokenizer_class": "Qwen2Tokenizer", "processor_class": "Qwen2_5_VLProcessor",
              "additional_special_tokens": [t for t in special if t != "<|endoftext|>"],
              "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                "single_word": False, "special": True} for t, i in special.items()}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return root


def bare_model_dir(model_dir, dest):
    """A copy of a model directory without text_encoder/, tokenizer/ and processor/ (a user with the transformer,
    VAE and scheduler in diffusers layout and the text encoder only as ComfyUI's file)."""
    import shutil
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns("text_encoder", "tokenizer", "processor"))
    return dest


def _embeddings(te, variant="edit"):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    with torch.no_grad():
        return encode.encode_prompts(te.model, te.processor, PROMPTS, [[image]] * len(PROMPTS), variant,
                                     device=CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_comfy_layout_file_gives_identical_prompt_embeddings(tiny_edit_dir, tmp_path, dtype):
    save_file(comfy_te_state(tiny_edit_dir, dtype), tmp_path / "qwen_2.5_vl_7b.safetensors")
    from_file = load_text_encoder(tiny_edit_dir, device=CPU, dtype=dtype,
                                  text_encoder_file=tmp_path / "qwen_2.5_vl_7b.safetensors")
    from_dir = load_text_encoder(tiny_edit_dir, device=CPU, dtype=dtype)
    reference = from_dir.model.state_dict()
    assert all(torch.equal(from_file.model.state_dict()[k], v) for k, v in reference.items())
    for a, b in zip(_embeddings(from_file), _embeddings(from_dir)):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("prefix, extra", [
    # ComfyUI's CLIPSave node: the TE module's state dict, logit_scale beside the transformer
    ("qwen25_7b.transformer.", {"qwen25_7b.logit_scale": torch.tensor(4.6052)}),
    # a full checkpoint (comfy/supported_models.py QwenImage.text_encoder_key_prefix); the rest is ignored
    ("text_encoders.qwen25_7b.transformer.", {"text_encoders.qwen25_7b.logit_scale": torch.tensor(4.6052),
                                              "model.diffusion_model.img_in.weight": torch.zeros(2, 2)})])
def test_file_without_lm_head_and_with_comfy_prefixes(tiny_plus_dir, tmp_path, prefix, extra):
    """ComfyUI does not build lm_head: such a file loads with lm_head tied (the hidden states do not use it)."""
    state = comfy_te_state(tiny_plus_dir, lm_head=False, prefix=prefix)
    save_file({**state, **extra}, tmp_path / "te.safetensors")
    from_file = load_text_encoder(tiny_plus_dir, device=CPU, dtype=torch.float32,
                                  text_encoder_file=tmp_path / "te.safetensors")
    from_dir = load_text_encoder(tiny_plus_dir, device=CPU, dtype=torch.float32)
    assert from_file.model.config.tie_word_embeddings
    for a, b in zip(_embeddings(from_file, "edit-plus"), _embeddings(from_dir, "edit-plus")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("new_format, fp8_bias", [(False, False), (False, True), (True, False)])
def test_scaled_fp8_file_is_upcast_within_tolerance(tiny_edit_dir, tmp_path, new_format, fp8_bias):
    """e4m3fn keeps 3 mantissa bits: prompt embeddings stay within 10% relative error (L2) of the directory's."""
    save_file(scaled_fp8(comfy_te_state(tiny_edit_dir), new_format, fp8_bias),
              tmp_path / "qwen_2.5_vl_7b_fp8_scaled.safetensors")
    from_file = load_text_encoder(tiny_edit_dir, device=CPU, dtype=torch.float32,
                                  text_encoder_file=tmp_path / "qwen_2.5_vl_7b_fp8_scaled.safetensors")
    from_dir = load_text_encoder(tiny_edit_dir, device=CPU, dtype=torch.float32)
    q_proj = from_file.model.model.language_model.layers[0].self_attn.q_proj.weight
    assert q_proj.dtype == torch.float32 and not torch.equal(
        q_proj, from_dir.model.model.language_model.layers[0].self_attn.q_proj.weight)
    for a, b in zip(_embeddings(from_file), _embeddings(from_dir)):
        assert a.dtype == torch.float32
        assert ((a - b).norm() / b.norm()).item() < 0.1


def test_comfy_bundled_tokenizer_gives_identical_token_ids(tiny_edit_dir, tmp_path):
    from transformers import Qwen2VLProcessor

    from qwen_edit_core.families.templates import EDIT_PLUS_TEMPLATE, EDIT_TEMPLATE
    comfyui = fake_comfyui(tiny_edit_dir, tmp_path / "ComfyUI")
    ours = load_processor(None, comfyui)
    theirs = Qwen2VLProcessor.from_pretrained(tiny_edit_dir / "processor")
    texts = [EDIT_TEMPLATE.format("make the sky purple"), EDIT_PLUS_TEMPLATE.format("Picture 1: x ünïcode ✓"), ""]
    for text in texts:
        assert ours.tokenizer(text)["input_ids"] == theirs.tokenizer(text)["input_ids"]
    # ComfyUI's folder itself is accepted too; the image processor has Qwen-Image's settings
    direct = load_processor(None, comfyui / "comfy" / "text_encoders" / "qwen25_tokenizer")
    assert direct.image_processor.size == {"shortest_edge": 3136, "longest_edge": 12845056}
    assert direct.image_processor.patch_size == 14 and direct.image_processor.merge_size == 2
    # the model directory's processor/ wins over ComfyUI's when both exist
    assert processor_source(tiny_edit_dir, comfyui) == tiny_edit_dir / "processor"


def test_sampler_with_file_and_comfy_tokenizer_equals_the_directory(tiny_edit_dir, tmp_path):
    """A directory without text_encoder/, tokenizer/, processor/ + ComfyUI's tokenizer + the encoder file."""
    bare = bare_model_dir(tiny_edit_dir, tmp_path / "bare")
    save_file(comfy_te_state(tiny_edit_dir), tmp_path / "te.safetensors")
    comfyui = fake_comfyui(tiny_edit_dir, tmp_path / "ComfyUI")
    plan = DevicePlan.from_mapping({})
    with pytest.raises(ModelNotFoundError, match="no tokenizer for the text encoder.*comfyui_dir"):
        load_components(bare, plan, which=("text_encoder",), text_encoder_file=tmp_path / "te.safetensors")
    from_file = load_components(bare, plan, text_encoder_file=tmp_path / "te.safetensors", comfyui_dir=comfyui)
    from_dir = load_components(tiny_edit_dir, plan)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    settings = sampler.SampleSettings(num_inference_steps=2, seed=2, width=64, height=64, vae_area=64 * 64)
    assert torch.equal(sampler.sample(from_file, "blue", [image], settings),
                       sampler.sample(from_dir, "blue", [image], settings))


def test_bad_files_name_what_was_expected(tiny_edit_dir, tmp_path):
    from transformers import Qwen2VLProcessor
    tokenizer = Qwen2VLProcessor.from_pretrained(tiny_edit_dir / "processor").tokenizer
    state = comfy_te_state(tiny_edit_dir)

    def load(name, tensors):
        save_file(tensors, tmp_path / name)
        return load_text_encoder_file(tmp_path / name, device=CPU, dtype=torch.float32, tokenizer=tokenizer)

    broken = dict(state)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(SingleFileError, match=r"missing \['model.language_model.layers.1.mlp.up_proj.weight'\]"):
        load("missing.safetensors", broken)
    wrong = dict(state)
    wrong["visual.blocks.0.attn.proj.weight"] = torch.zeros(32, 7)
    with pytest.raises(SingleFileError, match=r"wrong shapes.*attn.proj.weight: \(32, 7\) \(expected \(32, 32\)\)"):
        load("wrong.safetensors", wrong)
    no_vision = {k: v for k, v in state.items() if not k.startswith("visual.")}
    with pytest.raises(SingleFileError, match="missing 'model.visual.*vision tower"):
        load("novision.safetensors", no_vision)
    with pytest.raises(SingleFileError, match="keys outside Qwen2.5-VL's layout.*expected model"):
        load("t5.safetensors", {"encoder.block.0.layer.0.SelfAttention.k.weight": torch.zeros(4, 4)})
    with pytest.raises(SingleFileError, match="not a Qwen2.5-VL text encoder"):
        load("empty_lm.safetensors", {"model.norm.weight": torch.zeros(4)})
    odd = dict(state)
    odd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 32)
    with pytest.raises(SingleFileError, match="unknown Qwen2.5-VL architecture.*known: qwen2.5-vl-7b, qwen-edit-tiny"):
        load("odd.safetensors", odd)
    small = dict(state)
    small["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:500].clone()
    with pytest.raises(SingleFileError, match="outside the encoder's vocabulary of 500"):
        load("small_vocab.safetensors", small)
    nvfp4 = scaled_fp8(state, new_format=True)
    nvfp4["model.layers.0.mlp.up_proj.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    with pytest.raises(SingleFileError, match="quantized as 'nvfp4'.*only bf16/fp16/fp32 and scaled fp8"):
        load("nvfp4.safetensors", nvfp4)
    with pytest.raises(SingleFileError, match="does not exist"):
        load_text_encoder_file(tmp_path / "nope.safetensors", device=CPU, dtype=torch.float32, tokenizer=tokenizer)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SingleFileError, match="not a readable safetensors file"):
        load_text_encoder_file(tmp_path / "junk.safetensors", device=CPU, dtype=torch.float32, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="quantize='nf4' is not available for a single text encoder file"):
        load_text_encoder(tiny_edit_dir, device=CPU, dtype=torch.float32, quantize="nf4",
                          text_encoder_file=tmp_path / "missing.safetensors")


def test_missing_tokenizer_files_are_named(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model directory was given.*qwen25_tokenizer"):
        load_processor(None)
    folder = tmp_path / "ComfyUI" / "comfy" / "text_encoders" / "qwen25_tokenizer"
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text("{}")
    with pytest.raises(SingleFileError, match="lacks merges.txt, tokenizer_config.json"):
        load_processor(None, tmp_path / "ComfyUI")


def test_file_names_resolve_in_a_comfyui_models_folder(tmp_path):
    models = tmp_path / "models"
    (models / "text_encoders").mkdir(parents=True)
    (models / "text_encoders" / "qwen_2.5_vl_7b.safetensors").write_bytes(b"x")
    assert resolve_model_file("qwen_2.5_vl_7b.safetensors", "text_encoder", models) == \
        models / "text_encoders" / "qwen_2.5_vl_7b.safetensors"
    assert resolve_model_file("", "text_encoder", models) is None
    with pytest.raises(ModelNotFoundError, match="neither a file nor in .*diffusion_models"):
        resolve_model_file("qwen_image_edit.safetensors", "transformer", models)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_file("x.safetensors", "vae", tmp_path / "nowhere")


def _comfyui_with_models(model_dir, root):
    """A fake ComfyUI installation: the bundled tokenizer and models/text_encoders/qwen_2.5_vl_7b.safetensors."""
    comfyui = fake_comfyui(model_dir, root)
    (comfyui / "models" / "text_encoders").mkdir(parents=True)
    save_file(comfy_te_state(model_dir), comfyui / "models" / "text_encoders" / "qwen_2.5_vl_7b.safetensors")
    return comfyui


def test_cli_sample_takes_a_file_name_of_a_comfyui_models_folder(tiny_edit_dir, tmp_path, capsys):
    """--text-encoder-file as a file name of models/text_encoders/, the tokenizer found in the ComfyUI installation
    the models folder belongs to: the image equals the model directory's."""
    from qwen_edit_core.cli import main
    bare = bare_model_dir(tiny_edit_dir, tmp_path / "bare")
    comfyui = _comfyui_with_models(tiny_edit_dir, tmp_path / "ComfyUI")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "in.png")
    common = ["sample", "--image", str(tmp_path / "in.png"), "--prompt", "x", "--steps", "1", "--vae-area", "4096"]
    assert main(common + ["--model", str(bare), "--text-encoder-file", "qwen_2.5_vl_7b.safetensors",
                          "--comfyui-models-dir", str(comfyui / "models"), "--out", str(tmp_path / "a.png")]) == 0
    assert main(common + ["--model", str(tiny_edit_dir), "--out", str(tmp_path / "b.png")]) == 0
    assert np.array_equal(np.asarray(Image.open(tmp_path / "a.png")), np.asarray(Image.open(tmp_path / "b.png")))
    capsys.readouterr()
    assert main(common + ["--model", str(bare), "--out", str(tmp_path / "c.png"), "--text-encoder-file",
                          str(comfyui / "models" / "text_encoders" / "qwen_2.5_vl_7b.safetensors")]) == 2
    assert "no tokenizer for the text encoder" in capsys.readouterr().err
    assert main(common + ["--model", str(bare), "--text-encoder-file", "nope.safetensors", "--comfyui-models-dir",
                          str(comfyui / "models"), "--out", str(tmp_path / "d.png")]) == 2
    assert "text_encoders" in capsys.readouterr().err


def test_training_config_takes_a_text_encoder_file(tiny_edit_dir, tmp_path):
    """model.text_encoder_file + model.comfyui_dir: the cache key names the file and ComfyUI's tokenizer (a new
    entry), its tensors equal the directory's, and training runs from it."""
    from conftest import make_pairs, train_config
    pairs_dir = make_pairs(tmp_path / "pairs", n=2)

    from qwen_edit_core import QwenImageEditTrainer
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    bare = bare_model_dir(tiny_edit_dir, tmp_path / "bare")
    comfyui = _comfyui_with_models(tiny_edit_dir, tmp_path / "ComfyUI")
    te_file = comfyui / "models" / "text_encoders" / "qwen_2.5_vl_7b.safetensors"
    from_file = QwenImageEditTrainer(train_config(bare, pairs_dir, tmp_path / "file", model={
        "text_encoder_file": str(te_file), "comfyui_dir": str(comfyui)}, train={"max_steps": 2}))
    from_dir = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "dir"))
    assert from_dir._identity(tiny_edit_dir) == encoder_identity(tiny_edit_dir)  # directory caches stay valid
    assert from_file._identity(bare) != encoder_identity(bare) != from_dir._identity(tiny_edit_dir)
    assert from_file.cache()["computed"] == 2 and from_dir.cache()["computed"] == 2
    settings = from_dir.encode_settings("edit")
    for example in from_dir.dataset().examples:
        ta = from_file._cache().get(cache_key(example, settings, from_file._identity(bare)))
        tb = from_dir._cache().get(cache_key(example, settings, from_dir._identity(tiny_edit_dir)))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert from_file.fit().step == 2


def test_loader_nodes_take_a_text_encoder_file_and_the_running_comfyuis_tokenizer(tiny_edit_dir, pairs_dir,
                                                                                   tmp_path, monkeypatch):
    """Inside ComfyUI (faked: a `comfy` package and `folder_paths`), the file comes from the text_encoders list
    and the tokenizer from the running ComfyUI; the new input is the last one; loading in inference mode gives
    trainable-safe weights; the train node's config carries the file."""
    import sys
    import types

    import nodes
    from nodes.common import DatasetHandle
    from nodes.train_nodes import _config
    from qwen_edit_core.data.dataset import load_dataset
    from qwen_edit_core.families.qwen_image.text_encoder_file import COMFY_TOKENIZER_DIR
    comfyui = _comfyui_with_models(tiny_edit_dir, tmp_path / "ComfyUI")
    bare = bare_model_dir(tiny_edit_dir, tmp_path / "bare")
    comfy = types.ModuleType("comfy")
    comfy.__path__ = [str(comfyui / "comfy")]
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.models_dir = str(comfyui / "models")
    folder_paths.folder_names_and_paths = {"qwen_edit": ([], set())}
    folder_paths.get_folder_paths = lambda kind: [str(comfyui / "models" / kind)]
    folder_paths.get_filename_list = lambda kind: sorted(p.name for p in (comfyui / "models" / kind).glob("*"))
    folder_paths.get_full_path_or_raise = lambda kind, name: str(comfyui / "models" / kind / name)
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)

    for node, tail in ((nodes.QwenEditTextEncoderLoader, ["text_encoder_file"]),
                       (nodes.QwenEditModelLoader, ["text_encoder_file", "instance", "transformer_fp8"])):
        optional = node.INPUT_TYPES()["optional"]
        names = list(optional)  # new inputs go last: this one, then only the ones added after it
        assert names[names.index("text_encoder_file"):] == tail
        assert optional["text_encoder_file"][0][1:] == ["qwen_2.5_vl_7b.safetensors"]
    with torch.inference_mode():
        (te,) = nodes.QwenEditTextEncoderLoader().load("unused", "cpu", "float32", "none", path=str(bare),
                                                       text_encoder_file="qwen_2.5_vl_7b.safetensors")
        (handle,) = nodes.QwenEditModelLoader().load("unused", "cpu", "cpu", "cpu", "float32", str(bare),
                                                     "(from the model directory)", "(from the model directory)",
                                                     "qwen_2.5_vl_7b.safetensors")
    assert te.processor_dir == comfyui / COMFY_TOKENIZER_DIR
    assert te.weights_file == comfyui / "models" / "text_encoders" / "qwen_2.5_vl_7b.safetensors"
    assert not any(p.is_inference() for p in te.model.parameters())
    from_dir = load_text_encoder(tiny_edit_dir, device=CPU, dtype=torch.float32)
    for a, b in zip(_embeddings(te), _embeddings(from_dir)):
        assert torch.equal(a, b)
    config = _config(handle, DatasetHandle(pairs_dir, load_dataset(pairs_dir)), output_dir=tmp_path / "out",
                     resolution=64, cache_dir=str(tmp_path / "cache"))
    assert config.model.text_encoder_file == str(te.weights_file)
    assert config.model.comfyui_dir == str(comfyui)
