"""EMA of the LoRA: the closed form over a fixed sequence of updates, the saved file, exact resume."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.common.progress import CancelToken
from qwen_edit_core.train.ema import LoraEma

from conftest import train_config
from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32


def test_ema_equals_the_closed_form_over_a_fixed_sequence():
    """shadow_n = d^n p_0 + (1 - d) sum_k d^(n-k) p_k, in float64 by hand."""
    torch.manual_seed(0)
    decay = 0.9
    param = torch.nn.Parameter(torch.randn(3, 5))
    values = [param.detach().double().clone()]
    ema = LoraEma({"w": param}, decay)
    for _ in range(7):
        with torch.no_grad():
            param.add_(torch.randn(3, 5))
        values.append(param.detach().double().clone())
        ema.update({"w": param})
    n = len(values) - 1
    expected = decay ** n * values[0] + sum((1 - decay) * decay ** (n - k) * values[k] for k in range(1, n + 1))
    # seven float32 updates (a product, a product and a sum each) against float64
    assert_close_fp32(ema.shadow["w"].double(), expected, ops=7 * 3, what="EMA vs the closed form")
    before = param.detach().clone()
    with ema.applied({"w": param}):
        assert torch.equal(param.detach(), ema.shadow["w"])
    assert torch.equal(param.detach(), before)


@pytest.mark.parametrize("decay", [-0.1, 1.0])
def test_bad_ema_decay_is_named(decay):
    with pytest.raises(ValueError, match="train.ema_decay"):
        LoraEma({"w": torch.nn.Parameter(torch.zeros(1))}, decay)


def test_training_writes_the_ema_lora_beside_the_trained_one(tiny_edit_dir, pairs_dir, tmp_path):
    """With decay 0.5 over 3 steps the EMA file is 1/8 init + 1/8 p1 + 1/4 p2 + 1/2 p3 of the checkpoints."""
    out = tmp_path / "o"
    result = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, out, train={
        "max_steps": 3, "ema_decay": 0.5, "checkpoint_every": 1, "keep_checkpoints": 0})).fit()
    ema_file = out / "lora_ema.safetensors"
    assert ema_file.is_file() and result.lora_path == out / "lora.safetensors"
    trained, ema = load_file(result.lora_path), load_file(ema_file)
    assert trained.keys() == ema.keys()
    steps = [load_file(out / "checkpoints" / f"step-{s:07d}" / "lora.safetensors") for s in (1, 2, 3)]
    for key in ema:
        if key.endswith(".alpha"):
            continue
        # lora_up starts at zero (peft's init); lora_down's init is the step-0 value: recover it from step 1's
        # checkpointed EMA, 0.5 init + 0.5 p1.
        ema1 = load_file(out / "checkpoints" / "step-0000001" / "ema.safetensors")
        name = next(k for k in ema1 if _comfy_key(k) == key)
        init = 2 * ema1[name] - steps[0][key]
        expected = init / 8 + steps[0][key] / 8 + steps[1][key] / 4 + steps[2][key] / 2
        # three float32 updates (3 roundings each) against the formula's own 6 (the init recovered, 4 terms)
        assert_close_fp32(ema[key], expected, ops=3 * 3 + 6, what=f"EMA {key}")
    assert any(not torch.equal(ema[k], trained[k]) for k in ema if not k.endswith(".alpha"))


def _comfy_key(param_name: str) -> str:
    """peft parameter name -> our ComfyUI key (transformer_blocks.0.attn.to_q.lora_A.default.weight)."""
    module, kind = param_name.split(".lora_")
    return f"diffusion_model.{module}.{'lora_down' if kind.startswith('A') else 'lora_up'}.weight"


def test_ema_resume_equals_uninterrupted(tiny_edit_dir, pairs_dir, tmp_path):
    sections = {"train": {"max_steps": 4, "checkpoint_every": 2, "ema_decay": 0.7}}
    full = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "full", **sections)).fit()
    assert full.step == 4
    out, token = tmp_path / "stopped", CancelToken()

    def stop_at_2(event):
        if event.stage == "train" and event.step == 2:
            token.cancel()

    config = train_config(tiny_edit_dir, pairs_dir, out, **sections)
    assert QwenImageEditTrainer(config).fit(progress=stop_at_2, cancel=token).step == 2
    resumed = QwenImageEditTrainer(config).fit(resume=True)
    assert resumed.step == 4
    a, b = load_file(tmp_path / "full" / "lora_ema.safetensors"), load_file(out / "lora_ema.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same steps, bit for bit


def test_validation_can_use_the_ema(tiny_edit_dir, pairs_dir, tmp_path):
    """ema_validation samples with the averaged LoRA: with decay near 1 it stays at the (zero-delta) init, so
    its validation image equals the base model's."""
    common = {"max_steps": 2, "validation_every": 2, "validation_steps": 2,
              "validation_image": str(pairs_dir / "p0_control.png"), "validation_prompt": "invert the colors"}
    runs = {}
    for name, extra in (("ema", {"ema_decay": 0.999999, "ema_validation": True}), ("plain", {}),
                        ("base", {})):
        opt = {"lr": 1e-12} if name == "base" else {"lr": 1e-2}
        runs[name] = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / name,
                                                       train={**common, **extra}, optimizer=opt)).fit()
    lat = {n: load_file(tmp_path / n / "validation" / "step-0000002.safetensors")["latents_0"] for n in runs}
    # The average moved from the init by (1 - decay) of two steps of lr 1e-2, a few 1e-8 of a weight, under one
    # rounding of the LoRA's output: the two validation runs (2 steps, latents) differ by their rounding only
    assert_close_fp32(lat["ema"], lat["base"], ops=2 * TINY_FORWARD_ROUNDINGS, what="validation with the EMA")
    assert (lat["plain"] - lat["base"]).abs().max() > 1e-3


def test_cli_flags_override_the_config():
    from qwen_edit_core.cli import build_parser, train_overrides
    args = build_parser().parse_args(["train", "c.yaml", "--ema-decay", "0.99", "--ema-validation"])
    assert train_overrides(args) == {"train": {"ema_decay": 0.99, "ema_validation": True}}
    assert train_overrides(build_parser().parse_args(["train", "c.yaml"])) == {}
