"""Compiled blocks stay compiled across what changes in real runs: prompts keep their exact lengths (no mask at
batch 1) with one graph over many lengths, padded prompts keep the numbers, LoRA strengths are graph inputs,
and a compile failure falls back to eager with one warning. The inductor runs (training and sampling with compile on) live in test_compile_runs.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from qwen_edit_core import speed
from qwen_edit_core.adapters import lora, multires
from qwen_edit_core.model.encode import pad_embeddings
from qwen_edit_core.families.qwen_image.tiny import transformer_config
from qwen_edit_core.speed import compile as compile_mod

from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32


@pytest.fixture
def dynamo_reset():
    """Forget the compiled graphs afterwards: a function that hit the recompile limit stays marked in dynamo."""
    yield
    torch._dynamo.reset()


def _model(batching: bool):
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**transformer_config("tiny", num_layers=2)).eval()
    lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["attn"]))
    with torch.no_grad():
        for layer in lora.adapter_layers(model).values():
            layer.lora_B["default"].weight.normal_(0, 0.2)
    if batching:
        multires.install(model)
    return model


def _run(model, text, hidden, shapes):
    with torch.no_grad():
        return model(hidden_states=hidden, timestep=torch.full((hidden.shape[0],), 0.7),
                     encoder_hidden_states=text.embeds, encoder_hidden_states_mask=text.mask_or_none(),
                     img_shapes=shapes, return_dict=False)[0]


@pytest.mark.parametrize("batching", [False, True], ids=["stock-attention", "batching-adapter"])
def test_text_padded_to_a_bucket_gives_the_unpadded_output(batching):
    """Prompts padded with masked tokens to a multiple of 64 give the exact-length output up to float32
    rounding, alone and in a batch of two lengths (both attention processors)."""
    model = _model(batching)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randn(n, 32, generator=g) for n in (23, 41)]
    hidden = torch.randn(2, 2 * 20, 64, generator=g)
    shapes = [[(1, 4, 5), (1, 4, 5)]] * 2
    for idx in ([0], [1], [0, 1]):
        exact = pad_embeddings([prompts[i] for i in idx])
        bucketed = exact.padded(64)
        assert bucketed.embeds.shape[1] == 64 and bucketed.mask_or_none() is not None
        expected = _run(model, exact, hidden[: len(idx)], shapes[: len(idx)])
        # masked keys add zeros to the softmax's and the values' sums, in other kernels' order
        assert_close_fp32(_run(model, bucketed, hidden[: len(idx)], shapes[: len(idx)]), expected,
                          ops=TINY_FORWARD_ROUNDINGS, what=f"output with prompts {idx} padded to the bucket")


def test_lora_strengths_become_tensors_with_the_same_numbers():
    """use_adapters turns peft's per-adapter scales into 0-d tensors (graph inputs for compiled blocks); the
    output is the one of peft's float scales."""
    model = _model(False)
    g = torch.Generator().manual_seed(2)
    text, hidden = pad_embeddings([torch.randn(30, 32, generator=g)]), torch.randn(1, 40, 64, generator=g)
    shapes = [[(1, 4, 5), (1, 4, 5)]]
    for strength in (0.3, 1.7):
        model.set_adapters(["default"], weights=[strength])  # peft: float scales
        expected = _run(model, text, hidden, shapes)
        lora.use_adapters(model, ["default"], [strength])
        scales = [layer.scaling["default"] for layer in lora.adapter_layers(model).values()]
        assert all(isinstance(s, torch.Tensor) and s.dim() == 0 for s in scales)
        assert scales[0].item() == pytest.approx(strength)
        torch.testing.assert_close(_run(model, text, hidden, shapes), expected, atol=0, rtol=0)


class _Block(torch.nn.Linear):
    """A block whose forward reads a Python string (a value dynamo compiles in and guards on)."""

    tag = "a"

    def forward(self, x):
        return super().forward(x) * len(self.tag)


class _Toy(torch.nn.Module):
    """A stand-in with `transformer_blocks` (fast to trace)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.transformer_blocks = torch.nn.ModuleList(_Block(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.transformer_blocks:
            x = block(x)
        return x

    def set_tag(self, value: str) -> None:
        for block in self.transformer_blocks:
            block.tag = value


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler here")


@pytest.mark.parametrize("backend", [_failing_backend, "eager"], ids=["backend-error", "recompile-limit"])
def test_a_compile_failure_falls_back_to_eager_with_one_warning(backend, caplog, monkeypatch, dynamo_reset):
    """A backend error, or the recompile limit under fullgraph (a guarded value changed 12 times, limit 8),
    does not fail the run: every block runs eagerly from then on, the output is the eager one, one warning
    says why."""
    monkeypatch.setattr(compile_mod, "RECOMPILE_LIMIT", 8)
    model, reference = _Toy(), _Toy()
    assert speed.compile_blocks(model, backend=backend) == 3
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.speed.compile"):
        for i in range(12):
            model.set_tag("a" * (i + 1))
            reference.set_tag("a" * (i + 1))
            torch.testing.assert_close(model(x), reference(x))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "qwen_edit_core.speed.compile"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    stats = speed.compile_stats(model)
    expected = "no compiler here" if backend is _failing_backend else "recompile limit (8)"
    assert expected in warnings[0].getMessage() and expected in stats.fallback
    assert not stats.active
    assert all(block._compiled_call_impl is None for block in model.transformer_blocks)


def test_an_input_error_is_raised_and_keeps_the_blocks_compiled():
    """An error the eager call raises too (a wrong input) is the caller's: it is raised, nothing falls back."""
    model = _Toy()
    speed.compile_blocks(model, backend="eager")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model(torch.randn(4, 5))
    assert speed.compile_stats(model).active
    assert model(torch.randn(2, 8)).shape == (2, 8)


def test_a_copy_of_a_compiled_transformer_is_not_compiled():
    """Deep copies (split-CFG replicas) drop compiled calls as nn.Module pickling does."""
    model = _Toy()
    speed.compile_blocks(model, backend="eager")
    clone = copy.deepcopy(model)
    assert speed.compile_stats(model).active and not speed.compile_stats(clone).active


@pytest.mark.parametrize("mode", compile_mod.CUDA_GRAPH_MODES)
def test_a_cuda_graph_mode_is_refused_before_anything_is_compiled(mode):
    """CUDA-graph modes cannot serve a block graph that every block of a forward replays (each replay overwrites the
    previous block's outputs): the request is refused by name, and the blocks stay as they were."""
    model = _Toy()
    with pytest.raises(ValueError, match=mode):
        speed.compile_blocks(model, mode=mode)
    assert speed.compile_stats(model) is None
    assert all(block._compiled_call_impl is None for block in model.transformer_blocks)


@pytest.mark.parametrize("batching", [False, True], ids=["stock-attention", "batching-adapter"])
def test_compiled_blocks_get_exact_prompts_without_a_mask_and_one_graph_over_many_lengths(batching, dynamo_reset):
    """The sampler's prompts reach compiled blocks at their exact length (no padding, no mask: attention stays on
    the fused kernels), and fourteen caption lengths, cond and uncond run one by one, compile no graph after the
    first length's (dynamic lengths; dynamo alone, the `eager` backend: the graphs are what is counted)."""
    from qwen_edit_core.families.qwen_image.sampler import Conditioning
    from qwen_edit_core.sample import sampler
    model = _model(batching)
    speed.compile_blocks(model, backend="eager")
    g = torch.Generator().manual_seed(2)
    shapes = [(1, 4, 5), (1, 4, 5)]
    settings = sampler.SampleSettings(true_cfg_scale=3.0, negative_prompt="", cfg_mode="sequential")
    first = None
    for n in range(7, 35, 2):
        if first is None and n > 7:
            first = speed.compile_stats(model).graphs
        cond = Conditioning(pad_embeddings([torch.randn(n, 32, generator=g)]),
                            pad_embeddings([torch.randn(n // 2 + 3, 32, generator=g)]),
                            torch.randn(1, 20, 64, generator=g), shapes, 80, 64)
        denoiser = sampler._Denoiser(model, cond, settings)
        assert [e.embeds.shape[1] for e in (cond.cond, cond.uncond)] == [n, n // 2 + 3]
        assert all(e.mask_or_none() is None for e in (cond.cond, cond.uncond))
        with torch.no_grad():
            denoiser(torch.randn(1, 20, 64, generator=g), torch.tensor([500.0]))
    stats = speed.compile_stats(model)
    # one graph per block structure (the last block has no LoRA on its discarded text stream: its own graph),
    # compiled at the first length; the thirteen lengths after it compile nothing more
    assert stats.fallback is None and stats.graphs == first == 2, stats
