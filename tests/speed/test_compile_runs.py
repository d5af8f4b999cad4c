"""Compile on (inductor, on the CPU) through whole runs: a training run over many caption lengths and two
buckets, and ten edits with changing prompts, negative prompts and LoRA strengths, keep the eager numbers
and compile a bounded number of block graphs (dynamo's recompile limit used to end such runs)."""

from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core import speed
from qwen_edit_core.adapters import lora
from qwen_edit_core.model.components import load_components
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.sample import sampler

from conftest import assert_compiled_lora_close, train_config
from tolerances import assert_close_fp32, tiny_sampler_roundings, tiny_training_roundings

pytestmark = pytest.mark.slow  # inductor compilation (minutes with a cold cache)

COMPILE_LOG = "qwen_edit_core.speed.compile"


def _compiled_graph_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == COMPILE_LOG and "compiled transformer block graph"
            in r.getMessage()]


def test_ten_compiled_edits_with_changing_prompts_negatives_and_strengths_match_eager(tiny_edit_dir, caplog):
    """Ten edits, each with its own prompt length, negative prompt and LoRA strength (two image sizes): the
    compiled blocks give the eager images within the float32 rounding of the sampler run and compile at most 2
    graphs (no grad, batch 1, padded text: one graph; a prompt of exactly 64 tokens would add the unmasked one)."""
    comps = load_components(tiny_edit_dir, DevicePlan.from_mapping({}, dtype="float32"))
    torch.manual_seed(5)
    lora.inject_lora(comps.transformer, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["attn"]))
    with torch.no_grad():
        for layer in lora.adapter_layers(comps.transformer).values():
            layer.lora_B["default"].weight.normal_(0, 0.2)
    eager = dataclasses.replace(comps, transformer=copy.deepcopy(comps.transformer))
    assert speed.compile_blocks(comps.transformer) == 2
    rng = np.random.default_rng(0)
    with caplog.at_level(logging.INFO, logger=COMPILE_LOG):
        for i in range(10):
            size = (96, 64) if i % 3 else (64, 96)  # 48 image tokens either way, other positions
            image = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
            prompt = "make it " + "very " * (4 * i) + "green"
            settings = sampler.SampleSettings(num_inference_steps=2, seed=i, true_cfg_scale=3.0,
                                              negative_prompt=["", "blurry", "dark " * (3 * i)][i % 3],
                                              vae_area=size[0] * size[1])
            images = []
            for components in (comps, eager):
                lora.use_adapters(components.transformer, ["default"], [0.25 + 0.2 * i])
                images.append(sampler.sample(components, prompt, [image], settings))
            # inductor fuses and reorders the blocks' arithmetic: the pictures differ by the run's rounding
            assert_close_fp32(images[0], images[1], ops=tiny_sampler_roundings(settings.num_inference_steps),
                              what=f"compiled vs eager picture, edit {i}")
    stats = speed.compile_stats(comps.transformer)
    assert stats.fallback is None and stats.graphs <= 2, stats
    assert len(_compiled_graph_lines(caplog)) == stats.graphs


def _pairs(folder, sizes, captions):
    """One before/after pair per (size, caption): target = inverted control."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for i, ((w, h), caption) in enumerate(zip(sizes, captions)):
        control = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(control).save(folder / f"p{i:02d}_control.png")
        Image.fromarray(255 - control).save(folder / f"p{i:02d}.png")
        (folder / f"p{i:02d}.txt").write_text(caption, encoding="utf-8")
    return folder


def _text_lengths(cache_dir) -> list[int]:
    from safetensors import safe_open
    lengths = []
    for path in sorted(cache_dir.rglob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            if "prompt_embeds" in fh.keys():
                lengths.append(fh.get_slice("prompt_embeds").get_shape()[0])
    return lengths


class _Runs:
    """Training runs of one config over twelve captions of twelve token lengths (several 64-token buckets) and
    images in two size buckets (72 and 48 tokens), batches of 2, eager or compiled."""

    def __init__(self, model_dir, root):
        self.model_dir, self.root = model_dir, root
        self.data = _pairs(root / "data", [(96, 96), (96, 64)] * 6,
                           [("invert the colors " + "now " * (5 * k)).strip() for k in range(12)])

    def fit(self, name: str, compile: bool):
        from qwen_edit_core import QwenImageEditTrainer
        config = train_config(self.model_dir, self.data, self.root / name, cache_dir=self.root / "cache",
                              model={"lora": {"rank": 4, "alpha": 4.0, "targets": "attn"}},
                              data={"vae_area": 7000, "batch_size": 2},
                              train={"max_steps": 6, "compile": compile}, logging={"plot": False})
        trainer = QwenImageEditTrainer(config)
        return trainer, trainer.fit()


@pytest.fixture(scope="module")
def runs(one_block_dir, tmp_path_factory):
    """The twelve-caption runs and their eager run (shared by the compiled runs it is compared with)."""
    runs = _Runs(one_block_dir, tmp_path_factory.mktemp("runs"))
    runs.eager = runs.fit("eager", False)[1]
    return runs


def test_training_compiled_by_a_backend_that_keeps_the_numbers_gives_the_eager_lora_bit_for_bit(runs, monkeypatch):
    """Compiled by `aot_eager` (dynamo and AOTAutograd's joint forward and backward graph, run by eager kernels:
    no fusion, no reordering), the run's losses and LoRA are the eager run's, bit for bit. A compiled block hands
    zero gradients, not none, to what its outputs the model discards feed: a LoRA there would take AdamW's weight
    decay only when compiled (`inject_lora` leaves those modules out: test_lora.py derives them by autograd)."""
    import functools

    from safetensors.torch import load_file

    from qwen_edit_core.speed import compile as compile_mod, levers
    monkeypatch.setattr(levers, "compile_blocks", functools.partial(compile_mod.compile_blocks, backend="aot_eager"))
    try:
        trainer, same = runs.fit("aot_eager", True)
    finally:
        torch._dynamo.reset()  # the inductor run after it compiles its own graphs
    stats = speed.compile_stats(trainer.components.transformer)
    assert stats.fallback is None and stats.graphs >= 1, stats
    assert same.history == runs.eager.history
    got, expected = load_file(same.lora_path), load_file(runs.eager.lora_path)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_compiled_training_over_twelve_caption_lengths_and_two_buckets_matches_eager(runs, caplog):
    """The twelve-caption runs (`_Runs`): the inductor-compiled run's losses and LoRA equal the eager run's within
    the float32 rounding of the training steps, one block graph compiles (dynamic lengths; gradients on, batch 2,
    padded text), and the run's log reports it."""
    from safetensors.torch import load_file

    eager = runs.eager
    lengths = _text_lengths(runs.root / "cache")
    assert len(set(lengths)) >= 12 and len({-(-n // 64) for n in lengths}) >= 2, lengths
    with caplog.at_level(logging.INFO):
        trainer, fast = runs.fit("compiled", True)
    stats = speed.compile_stats(trainer.components.transformer)
    assert stats.fallback is None and stats.graphs <= 1, stats
    assert len(_compiled_graph_lines(caplog)) == stats.graphs
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training done")]
    assert done and f"{stats.graphs} block graph(s) compiled" in done[-1], done
    assert [s for s, _ in fast.history] == [s for s, _ in eager.history] == list(range(1, 7))
    # inductor fuses and reorders each step's forward and backward; the rounding of a step's gradients moves the
    # weights the next step starts from, so step k's loss carries the rounding of k steps
    for step, ((_, a), (_, b)) in enumerate(zip(fast.history, eager.history), 1):
        assert_close_fp32(torch.tensor(a), torch.tensor(b), ops=tiny_training_roundings(step),
                          what=f"compiled vs eager loss at step {step}")
    opt = trainer.config.optimizer
    assert_compiled_lora_close(load_file(fast.lora_path), load_file(eager.lora_path),
                               ops=tiny_training_roundings(6), last_block=0, lr=opt.lr,
                               what="compiled vs eager LoRA after 6 steps")
