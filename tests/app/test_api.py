"""Config, device plan, loaders, facade and CLI: the contracts scripts and nodes rely on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core import QwenImageEditTrainer, load_config
from qwen_edit_core.cli import main
from qwen_edit_core.model.components import ModelNotFoundError, load_components, load_transformer
from qwen_edit_core.config import ConfigError
from qwen_edit_core.model.devices import DeviceError, DevicePlan, available_devices


def _write_image(path, w=96, h=64, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def test_config_rejects_unknown_key_by_path(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("predict:\n  devices:\n    vea: cpu\n")
    with pytest.raises(ConfigError, match=r"predict\.devices\.vea"):
        load_config(cfg)
    cfg.write_text("train:\n  max_steps: many\n")
    with pytest.raises(ConfigError, match=r"train\.max_steps"):
        load_config(cfg)


def test_config_reads_seed_sections(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  pretrained_model_name_or_path: /m\npredict:\n  devices:\n    vae: cpu\n"
                   "optimizer:\n  lr: 2.0e-4\n  betas: [0.9, 0.99]\n")
    config = load_config(cfg)
    assert config.model.pretrained_model_name_or_path == "/m"
    assert config.optimizer.betas == (0.9, 0.99) and config.optimizer.lr == 2e-4


def test_device_plan_names_component_and_lists_devices():
    with pytest.raises(DeviceError) as err:
        DevicePlan.from_mapping({"vae": "cuda:7"})
    assert "vae" in str(err.value) and "cuda:7" in str(err.value) and "cpu" in str(err.value)
    with pytest.raises(DeviceError, match="unknown component"):
        DevicePlan.from_mapping({"unet": "cpu"})
    with pytest.raises(DeviceError, match="not a device"):
        DevicePlan.parse("transformer=gpu-zero")
    assert "cpu" in available_devices()


def test_plan_is_checked_before_any_weight_loads(tmp_path):
    config = load_config(overrides={"model": {"pretrained_model_name_or_path": str(tmp_path / "missing")},
                                    "predict": {"devices": {"transformer": "cuda:3"}}})
    with pytest.raises(DeviceError, match="transformer"):
        QwenImageEditTrainer(config)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a local directory"):
        load_components(tmp_path / "nope", DevicePlan.from_mapping({}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="model_index.json"):
        load_components(tmp_path / "empty", DevicePlan.from_mapping({}))


def test_quantize_on_cpu_is_refused(tiny_edit_dir):
    with pytest.raises(DeviceError, match="CUDA"):
        load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32, quantize="nf4")


def test_loading_inside_inference_mode_gives_trainable_weights(tiny_edit_dir):
    """ComfyUI runs nodes under inference_mode: loaded weights must still support autograd for a LoRA."""
    with torch.inference_mode():
        comps = load_components(tiny_edit_dir, DevicePlan.from_mapping({}), which=("transformer",))
    model = comps.transformer
    assert not any(p.is_inference() for p in model.parameters())
    layer = model.transformer_blocks[0].attn.to_q
    delta = torch.zeros(layer.out_features, layer.in_features, requires_grad=True)
    x = torch.randn(2, layer.in_features)
    out = torch.nn.functional.linear(x, layer.weight + delta, layer.bias)
    out.square().sum().backward()
    assert delta.grad is not None and delta.grad.abs().sum() > 0


def test_facade_predict_and_encoders(tiny_edit_dir):
    config = load_config(overrides={"model": {"pretrained_model_name_or_path": str(tiny_edit_dir)},
                                    "predict": {"vae_area": 128 * 128}})
    trainer = QwenImageEditTrainer(config)
    trainer.load_model()
    trainer.setup_predict()
    image = Image.new("RGB", (96, 64), (200, 30, 30))
    out = trainer.predict(image, "make it green", num_inference_steps=2, seed=1)
    assert out.dtype == np.float32 and out.ndim == 3 and out.shape[2] == 3
    assert 0.0 <= out.min() and out.max() <= 1.0
    again = trainer.predict(image, "make it green", num_inference_steps=2, seed=1)
    assert np.array_equal(out, again)
    one_step = trainer.predict(image, "x", num_inference_steps=1, seed=1)
    assert np.isfinite(one_step).all()
    assert trainer.predict(image, "x", num_inference_steps=1, seed=1, output_type="pil").size == (out.shape[1],
                                                                                                out.shape[0])
    embeds, mask = trainer.encode_prompt("make it green", image)
    assert embeds.shape[:2] == mask.shape and mask.all()
    latents = trainer.encode_image(image)
    assert latents.shape[:3] == (1, 16, 1)
    assert trainer.decode_vae_latent(latents).shape[-1] == 3


def test_prompt_over_the_encoder_limit_is_refused(tiny_edit_dir):
    from qwen_edit_core.model.encode import EncodeError
    config = load_config(overrides={"model": {"pretrained_model_name_or_path": str(tiny_edit_dir)},
                                    "predict": {"vae_area": 64 * 64}})
    trainer = QwenImageEditTrainer(config)
    trainer.load_model(which=("text_encoder",))
    with pytest.raises(EncodeError, match="at most 1024"):
        trainer.encode_prompt("word " * 1100, Image.new("RGB", (32, 32)))


def test_a_1mp_controls_vision_tokens_do_not_count_against_the_prompt_limit(tiny_edit_dir):
    """With the real model's image-processor settings a 1024^2 Edit control is 1,369 vision tokens, so a short
    prompt is about 1,380 tokens after the template prefix: encoded (diffusers truncates nothing), while the
    limit still refuses a prompt whose own text is over 1,024 tokens, before the text encoder runs."""
    from qwen_edit_core.families.qwen_image import encode
    from qwen_edit_core.model.components import load_processor, load_text_encoder
    from qwen_edit_core.families.qwen_image.text_encoder_file import QWEN_IMAGE_PROCESSOR
    processor = load_processor(tiny_edit_dir)
    processor.image_processor.size = {"shortest_edge": QWEN_IMAGE_PROCESSOR["min_pixels"],
                                      "longest_edge": QWEN_IMAGE_PROCESSOR["max_pixels"]}
    te = load_text_encoder(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    control = Image.new("RGB", (1024, 1024), (90, 120, 200))
    (embeds,) = encode.encode_prompts(te.model, processor, ["invert the colors"], [[control]], "edit",
                                      device=torch.device("cpu"))
    assert embeds.shape[0] > 1369 + 3
    words = "word " * 300
    tokens = len(processor.tokenizer(words, add_special_tokens=False)["input_ids"])
    assert tokens > 1024
    with pytest.raises(encode.EncodeError, match=f"prompt 0 is {tokens} tokens; the text encoder takes at most 1024"):
        encode.encode_prompts(None, processor, [words], [[control]], "edit", device=torch.device("cpu"))


def test_cli_sample_writes_an_image(tiny_edit_dir, tmp_path):
    src = _write_image(tmp_path / "in.png")
    out = tmp_path / "out.png"
    code = main(["sample", "--model", str(tiny_edit_dir), "--image", str(src), "--prompt", "blue", "--steps", "2",
                 "--vae-area", str(128 * 128), "--cfg-mode", "batched", "--out", str(out)])
    assert code == 0 and Image.open(out).size == (160, 96)


@pytest.mark.parametrize("case, expected", [
    ("missing_model", "neither a local directory"),
    ("missing_image", "does not exist"),
    ("not_an_image", "not a readable image"),
    ("bad_device", "does not exist"),
    ("tiny_size", "latent patch"),
])
def test_cli_bad_input_exits_2_with_a_named_error(tiny_edit_dir, tmp_path, capsys, case, expected):
    src = _write_image(tmp_path / "in.png")
    args = {"--model": str(tiny_edit_dir), "--image": str(src), "--prompt": "p", "--steps": "1",
            "--vae-area": str(64 * 64), "--out": str(tmp_path / "o.png")}
    if case == "missing_model":
        args["--model"] = str(tmp_path / "no_model")
    elif case == "missing_image":
        args["--image"] = str(tmp_path / "nope.png")
    elif case == "not_an_image":
        (tmp_path / "t.png").write_text("hello")
        args["--image"] = str(tmp_path / "t.png")
    elif case == "bad_device":
        args["--devices"] = "transformer=cuda:5"
    elif case == "tiny_size":
        args["--width"] = "8"
    argv = ["sample"] + [x for kv in args.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_hub_id_not_in_local_cache_is_a_clear_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="local Hugging Face cache"):
        load_components("Qwen/Qwen-Image-Edit", DevicePlan.from_mapping({}))


def test_cli_cache_then_sample_with_two_loras(tiny_edit_dir, pairs_dir, tmp_path):
    import yaml
    from conftest import train_config
    from qwen_edit_core import QwenImageEditTrainer
    result = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "t",
                                               train={"max_steps": 2})).fit()
    cfg = {"model": {"pretrained_model_name_or_path": str(tiny_edit_dir)},
           "data": {"folder": str(pairs_dir), "vae_area": 4096}, "cache": {"dir": str(tmp_path / "cache")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["cache", str(tmp_path / "c.yaml")]) == 0
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 4
    out = tmp_path / "o.png"
    args = ["sample", "--model", str(tiny_edit_dir), "--image", str(pairs_dir / "p0_control.png"), "--prompt", "x",
            "--steps", "2", "--vae-area", "4096", "--seed", "1"]
    assert main(args + ["--out", str(tmp_path / "plain.png")]) == 0
    assert main(args + ["--lora", f"{result.lora_path}:0.5", "--lora", str(result.lora_path), "--out", str(out)]) == 0
    plain = np.asarray(Image.open(tmp_path / "plain.png"), dtype=np.float32)
    assert np.abs(np.asarray(Image.open(out), dtype=np.float32) - plain).max() > 0


def test_example_configs_parse(tmp_path, monkeypatch):
    from pathlib import Path

    import yaml
    monkeypatch.setenv("WORK", str(tmp_path))  # the toy examples name ${WORK}, the reader's working folder
    for path in sorted((Path(__file__).parents[2] / "examples").glob("*.yaml")):
        if "distributed_type" in yaml.safe_load(path.read_text()):
            continue  # an `accelerate launch --config_file` file (examples/fsdp2.yaml), not a training config
        load_config(path)


def test_config_values_read_environment_variables(tmp_path, monkeypatch):
    """`${NAME}` in a config file's strings is the environment variable NAME; an unset one is refused naming
    the file and the key; a `$` in any other form stays as written."""
    path = tmp_path / "c.yaml"
    path.write_text("train: {output_dir: '${QWEN_EDIT_TEST_WORK}/run', lora_name: 'a$b'}\n"
                    "model: {lora: {stack: [{path: '${QWEN_EDIT_TEST_WORK}/l.safetensors'}]}}\n")
    monkeypatch.delenv("QWEN_EDIT_TEST_WORK", raising=False)
    with pytest.raises(ConfigError, match=r"c.yaml.*train.output_dir.*QWEN_EDIT_TEST_WORK.*not set"):
        load_config(path)
    monkeypatch.setenv("QWEN_EDIT_TEST_WORK", "/data/w")
    config = load_config(path)
    assert config.train.output_dir == "/data/w/run" and config.train.lora_name == "a$b"
    assert config.model.lora.stack[0].path == "/data/w/l.safetensors"
