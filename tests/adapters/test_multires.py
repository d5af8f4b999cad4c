"""Mixed-resolution batches equal one-by-one: outputs, per-sample losses, gradients; fused path when uniform."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from qwen_edit_core.adapters import multires as batching
from qwen_edit_core.adapters import lora
from qwen_edit_core.families.qwen_image.tiny import transformer_config

from tolerances import TINY_FORWARD_ROUNDINGS, TINY_SAMPLER_ROUNDINGS, assert_close_fp32

# (target shape, control shapes, caption tokens) in packed units: three sizes, two with several controls.
SAMPLES = [((1, 4, 4), [(1, 4, 4)], 5), ((1, 3, 5), [(1, 2, 6), (1, 3, 3)], 9), ((1, 6, 2), [(1, 5, 3)], 3)]


def _model(zero_cond_t=False, dtype=torch.float32):
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**{**transformer_config("tiny"), "zero_cond_t": zero_cond_t})
    lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["all"]))
    with torch.no_grad():
        for layer in lora.adapter_layers(model).values():
            layer.lora_B["default"].weight.normal_(0, 0.1)
    return model.to(dtype)


def _inputs(dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for target, controls, n_text in SAMPLES:
        n_t = target[1] * target[2]
        n_c = sum(c[1] * c[2] for c in controls)
        out.append((torch.randn(n_t, 64, generator=g).to(dtype), torch.randn(n_c, 64, generator=g).to(dtype),
                    torch.randn(n_text, 32, generator=g).to(dtype), [target, *controls]))
    return out


def _alone(model, target, control, text, shapes, t):
    hidden = torch.cat([target, control])[None]
    return model(hidden_states=hidden, encoder_hidden_states=text[None], timestep=t, img_shapes=[shapes],
                 return_dict=False)[0][0, : target.shape[0]]


def _batched(model, inputs, t):
    from qwen_edit_core.model.encode import pad_embeddings
    packed = batching.pack_samples([i[0] for i in inputs], [i[1] for i in inputs], [i[3] for i in inputs])
    text = pad_embeddings([i[2] for i in inputs])
    out = model(hidden_states=packed.hidden, encoder_hidden_states=text.embeds,
                encoder_hidden_states_mask=text.mask_or_none(), timestep=t, img_shapes=packed.img_shapes,
                attention_kwargs=packed.attention_kwargs, return_dict=False)[0]
    return [out[b, : i[0].shape[0]] for b, i in enumerate(inputs)], packed


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("zero_cond_t", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_batch_equals_one_by_one(zero_cond_t, dtype):
    stock = _model(zero_cond_t, dtype)
    adapted = copy.deepcopy(stock)
    batching.install(adapted)
    adapted.enable_gradient_checkpointing()
    inputs = _inputs(dtype)
    t = torch.tensor([0.3, 0.6, 0.9], dtype=dtype)
    with torch.no_grad():
        outs, packed = _batched(adapted, inputs, t)
        for b, (target, control, text, shapes) in enumerate(inputs):
            ref = _alone(stock, target, control, text, shapes, t[b: b + 1])  # stock diffusers, one sample
            if dtype == torch.float32:  # a batch of other lengths: other kernels' sums, one forward's roundings
                assert_close_fp32(outs[b], ref, ops=TINY_FORWARD_ROUNDINGS, what=f"sample {b} in a padded batch")
            else:  # bfloat16 keeps 8 significant bits: each step of the forward rounds by up to 2^-9 relative
                assert _rel(outs[b], ref) < 1e-2
    assert packed.padding_fraction() > 0


def test_stock_diffusers_batch_is_wrong_which_is_why_the_adapter_exists():
    """Same token counts, different shapes: stock diffusers runs but uses sample 0's RoPE for both."""
    stock = _model()
    g = torch.Generator().manual_seed(3)
    shapes = [[(1, 4, 4), (1, 4, 4)], [(1, 2, 8), (1, 8, 2)]]
    hidden = torch.randn(2, 32, 64, generator=g)
    text = torch.randn(2, 5, 32, generator=g)
    t = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        out = stock(hidden_states=hidden, encoder_hidden_states=text, timestep=t, img_shapes=shapes,
                    return_dict=False)[0]
        ref = _alone(stock, hidden[1, :16], hidden[1, 16:], text[1], shapes[1], t[1:])
        adapted = copy.deepcopy(stock)
        batching.install(adapted)
        fixed = adapted(hidden_states=hidden, encoder_hidden_states=text, timestep=t, img_shapes=shapes,
                        return_dict=False)[0]
    assert _rel(out[1, :16], ref) > 1e-2
    assert_close_fp32(fixed[1, :16], ref, ops=TINY_FORWARD_ROUNDINGS, what="second sample in a mixed batch vs alone")


def test_per_sample_losses_and_gradients_match_and_padding_gets_none():
    from qwen_edit_core.sample import flow
    model = _model()
    batching.install(model)
    inputs = _inputs()
    t = torch.tensor([0.3, 0.6, 0.9])
    targets = [torch.randn_like(i[0]) for i in inputs]

    def single_loss(b):
        target, control, text, shapes = inputs[b]
        pred = _alone(model, target, control, text, shapes, t[b: b + 1])
        return (pred - targets[b]).square().mean()

    grads_single = []
    losses_single = []
    for b in range(3):
        model.zero_grad()
        loss = single_loss(b)
        loss.backward()
        losses_single.append(loss.item())
        # The last block's text-stream layers do not reach the image output: their grad stays None.
        grads_single.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                             for n, p in model.named_parameters() if p.requires_grad})
    model.zero_grad()
    hidden_inputs = [(i[0].clone().requires_grad_(True),) + i[1:] for i in inputs]
    outs, packed = _batched(model, hidden_inputs, t)
    n_max = max(o.shape[0] for o in outs)
    pred = torch.stack([torch.nn.functional.pad(o, (0, 0, 0, n_max - o.shape[0])) for o in outs])
    target = torch.stack([torch.nn.functional.pad(x, (0, 0, 0, n_max - x.shape[0])) for x in targets])
    mask = torch.arange(n_max)[None] < torch.tensor([o.shape[0] for o in outs])[:, None]
    loss, per_sample = flow.masked_mse(pred, target, torch.ones(3), mask)
    # one call per layout instead of one per sample: other kernels' sums, a forward's roundings (doubled by the
    # squared error)
    assert_close_fp32(per_sample, torch.tensor(losses_single), ops=2 * TINY_FORWARD_ROUNDINGS,
                      what="per-sample losses batched vs alone")
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            expected = sum(g[name] for g in grads_single) / 3
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            # a backward through the forward (about twice its roundings), the three samples' sums in another order
            assert_close_fp32(got, expected, ops=2 * TINY_FORWARD_ROUNDINGS + 3, what=f"gradient of {name}")


def test_padded_tokens_receive_no_gradient():
    model = _model()
    batching.install(model)
    inputs = _inputs()
    from qwen_edit_core.model.encode import pad_embeddings
    packed = batching.pack_samples([i[0] for i in inputs], [i[1] for i in inputs], [i[3] for i in inputs])
    hidden = packed.hidden.clone().requires_grad_(True)
    text = pad_embeddings([i[2] for i in inputs])
    embeds = text.embeds.clone().requires_grad_(True)
    out = model(hidden_states=hidden, encoder_hidden_states=embeds, encoder_hidden_states_mask=text.mask,
                timestep=torch.tensor([0.5] * 3), img_shapes=packed.img_shapes,
                attention_kwargs=packed.attention_kwargs, return_dict=False)[0]
    loss = sum(out[b, : n].square().sum() for b, n in enumerate(packed.n_target))
    loss.backward()
    assert hidden.grad[~packed.image_mask].abs().max().item() == 0.0
    assert embeds.grad[~text.mask.bool()].abs().max().item() == 0.0
    assert hidden.grad[packed.image_mask].abs().max().item() > 0


def test_uniform_batch_builds_no_mask_and_stays_fused():
    model = _model()
    processor = batching.install(model)
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 4, 4), (1, 4, 4)]
    packed = batching.pack_samples([torch.randn(16, 64, generator=g)] * 2, [torch.randn(16, 64, generator=g)] * 2,
                                   [shapes, shapes])
    assert packed.image_mask is None and packed.attention_kwargs is None
    with torch.no_grad():
        model(hidden_states=packed.hidden, encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
              timestep=torch.tensor([0.5, 0.5]), img_shapes=packed.img_shapes, return_dict=False)
    assert processor.calls == {"fused": 2, "masked": 0, "packed": 0}
    with torch.no_grad():
        _batched(model, _inputs(), torch.tensor([0.5] * 3))
    assert processor.calls["masked"] == 2


def test_sampler_batch_of_two_sizes_equals_two_single_edits(tiny_edit_dir):
    import numpy as np
    from PIL import Image

    from qwen_edit_core.sample import sampler
    from qwen_edit_core.sample.batch import sample_batch
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    comps = load_components(tiny_edit_dir, DevicePlan.from_mapping({}))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 255, (80, 64, 3), dtype=np.uint8))]
    prompts = ["make it blue", "add a small red hat to the cat"]
    settings = sampler.SampleSettings(num_inference_steps=3, true_cfg_scale=3.0, vae_area=96 * 96)
    singles = [sampler.sample(comps, p, [img], sampler.SampleSettings(**{**settings.__dict__, "seed": s}))
               for p, img, s in zip(prompts, images, (5, 6))]
    batched = sample_batch(comps, prompts, [[images[0]], [images[1]]], settings, seeds=[5, 6])
    for one, many in zip(singles, batched):
        assert one.shape == many.shape
        assert_close_fp32(many, one, ops=TINY_SAMPLER_ROUNDINGS, what="picture sampled in a batch vs alone")
    assert singles[0].shape != singles[1].shape
    with pytest.raises(ValueError, match="runs CFG on one device; use cfg_mode 'sequential' or 'batched'$"):
        split = sampler.SampleSettings(**{**settings.__dict__, "cfg_mode": "split"})
        sample_batch(comps, prompts[:1], [[images[0]]], split)


def _batched_packed(model, inputs, t):
    """`_batched` with variable-length attention over the valid tokens instead of the key mask."""
    from qwen_edit_core.model.encode import pad_embeddings
    packed = batching.pack_samples([i[0] for i in inputs], [i[1] for i in inputs], [i[3] for i in inputs])
    text = pad_embeddings([i[2] for i in inputs])
    kwargs = packed.packed_kwargs(text.lengths, text.embeds.shape[1])
    out = model(hidden_states=packed.hidden, encoder_hidden_states=text.embeds,
                encoder_hidden_states_mask=text.mask_or_none(), timestep=t, img_shapes=packed.img_shapes,
                attention_kwargs=kwargs, return_dict=False)[0]
    return [out[b, : i[0].shape[0]] for b, i in enumerate(inputs)], kwargs


def test_packed_layout_lists_each_samples_valid_text_then_image_tokens():
    layout = batching.packed_layout([2, 3], 3, [4, 1], 4, "cpu")
    assert layout["varlen_index"].tolist() == [0, 1, 3, 4, 5, 6, 7, 8, 9, 10]  # rows of 3 + 4 positions
    assert layout["varlen_offsets"].tolist() == [0, 6, 10] and layout["varlen_offsets"].dtype == torch.int32
    assert batching.packed_layout([3, 3], 3, [4, 4], 4, "cpu") is None  # nothing padded: no mask, no packing


def test_packed_attention_equals_the_masked_path_and_one_by_one():
    """Different text lengths and image sizes in one batch: variable-length attention over the valid tokens
    gives the masked path's outputs and gradients, and each sample's one-by-one output."""
    model = _model()
    processor = batching.install(model)
    inputs = _inputs()
    t = torch.tensor([0.3, 0.6, 0.9])
    got, kwargs = _batched_packed(model, inputs, t)
    assert kwargs is not None and processor.calls["packed"] == 2 and processor.calls["masked"] == 0
    masked, _ = _batched(model, inputs, t)
    for b, (target, control, text, shapes) in enumerate(inputs):
        # the same softmax sums in another order (a block-diagonal mask over packed tokens against a key mask)
        assert_close_fp32(got[b], masked[b], ops=TINY_FORWARD_ROUNDINGS, what=f"sample {b}: packed vs masked")
        alone = _alone(model, target, control, text, shapes, t[b: b + 1])
        assert_close_fp32(got[b], alone, ops=TINY_FORWARD_ROUNDINGS, what=f"sample {b}: packed vs alone")
    grads = []
    for run in (_batched_packed, _batched):
        model.zero_grad(set_to_none=True)
        out, _ = run(model, inputs, t)
        sum(o.square().sum() for o in out).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[1]:
        assert_close_fp32(grads[0][name], grads[1][name], ops=2 * TINY_FORWARD_ROUNDINGS,
                          what=f"gradient of {name}: packed vs masked")
