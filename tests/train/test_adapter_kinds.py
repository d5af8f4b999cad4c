"""Training with each adapter kind (LoKr, LoHa, DoRA) on the tiny model runs end to end: the file holds the
kind's keys, its weights moved from the init, and a run stopped and resumed equals an uninterrupted one."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.adapters import lora
from qwen_edit_core.common.progress import CancelToken

from conftest import train_config

KEYS = {"lokr": "lokr_w1", "loha": "hada_w1_a", "dora": "dora_scale"}


@pytest.mark.parametrize("kind", ["lokr", "loha", "dora"])
def test_training_each_kind_runs_and_resumes_exactly(tiny_edit_dir, pairs_dir, tmp_path, kind):
    lora_cfg = {"rank": 2, "alpha": 2.0, "targets": "attn-img", "type": "lora" if kind == "dora" else kind,
                "dora": kind == "dora"}
    sections = {"model": {"pretrained_model_name_or_path": str(tiny_edit_dir), "lora": lora_cfg},
                "train": {"max_steps": 2, "checkpoint_every": 1}}
    full = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "full", **sections)).fit()
    assert full.step == 2
    state = load_file(full.lora_path)
    assert any(k.endswith("." + KEYS[kind]) for k in state)
    weights = lora.read_lora_file(full.lora_path)
    assert weights.metadata["type"] == lora_cfg["type"] and weights.metadata["dora"] == str(kind == "dora").lower()
    first = load_file(tmp_path / "full" / "checkpoints" / "step-0000001" / "lora.safetensors")
    assert max((state[k] - first[k]).abs().max().item() for k in state) > 0  # it trains
    out, token = tmp_path / "stopped", CancelToken()

    def stop_at_1(event):
        if event.stage == "train" and event.step == 1:
            token.cancel()

    config = train_config(tiny_edit_dir, pairs_dir, out, **sections)
    assert QwenImageEditTrainer(config).fit(progress=stop_at_1, cancel=token).step == 1
    assert QwenImageEditTrainer(config).fit(resume=True).step == 2
    resumed = load_file(out / "lora.safetensors")
    assert max((state[k] - resumed[k]).abs().max().item() for k in state) == 0  # the same steps, bit for bit


def test_cli_flags_choose_the_kind():
    from qwen_edit_core.cli import build_parser, train_overrides
    args = build_parser().parse_args(["train", "c.yaml", "--lora-type", "lora", "--dora"])
    assert train_overrides(args) == {"model": {"lora": {"type": "lora", "dora": True}}}
    args = build_parser().parse_args(["train", "c.yaml", "--lora-type", "lokr", "--ema-decay", "0.9"])
    assert train_overrides(args) == {"model": {"lora": {"type": "lokr"}}, "train": {"ema_decay": 0.9}}
