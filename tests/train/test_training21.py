"""Training edit LoRAs on Qwen-Image-2.1 (the tiny 2.1 model, CPU, fp32): the example tensors and the training
forward are the diffusers QwenImage21Pipeline's own, the cache keeps 2.1 entries apart, cached == realtime,
mixed reference counts in a batch equal one by one, region masks, pixel-aligned pairs, caption dropout, EMA,
adapter kinds, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.common.progress import CancelToken
from qwen_edit_core.data.example_tensors import cache_key, encoder_identity

from conftest import make_pairs, make_ref_pairs, train_config
from tolerances import (TINY_FORWARD_ROUNDINGS, TINY_VAE_ROUNDINGS, assert_close_fp32, fp32_tolerance,
                        adam_trained_size, max_abs_diff, tiny_training_roundings)

SIDE = 64


@pytest.fixture(scope="module")
def simple_dir(tmp_path_factory):
    return make_pairs(tmp_path_factory.mktemp("data21") / "simple", n=4)


def _items(model_dir, folder, out, **sections):
    """(config, trainer with every component loaded, examples, their cached tensors)."""
    config = train_config(model_dir, folder, out, **sections)
    trainer = QwenImageEditTrainer(config)
    examples = list(trainer.dataset().examples)
    trainer.load_model()
    trainer.cache(examples)
    settings = trainer.encode_settings("image-2.1")
    items = [trainer._cache().get(cache_key(e, settings, encoder_identity(model_dir))) for e in examples]
    return config, trainer, examples, items


def _pipeline(comps):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    te = comps.text_encoder
    return QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(comps.scheduler_config),
                               vae=comps.vae, text_encoder=te.model, processor=te.processor,
                               transformer=comps.transformer)


def test_example_tensors_and_training_forward_are_the_pipelines(tiny_21_dir, refs_dir, tmp_path):
    """For the pair with 3 references: the cached prompt embeddings and slot mask are the pipeline's
    `encode_prompt` of the resized references, the reference latents its `prepare_latents`, and the training
    prediction is its transformer call on [references | noisy target] at the sampled sigma (target tokens)."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    from qwen_edit_core.train.batch import collate, predict, sample_generator
    config, trainer, examples, items = _items(tiny_21_dir, refs_dir, tmp_path / "o")
    comps, item, example = trainer.components, items[2], examples[2]
    pipe = _pipeline(comps)
    refs = [Image.open(p).convert("RGBA") for p in example.controls]
    sizes = [calculate_dimensions(SIDE * SIDE, r.width / r.height)[:2] for r in refs]  # the pipeline's own
    resized = [pipe.image_processor.resize(r, width=w, height=h) for r, (w, h) in zip(refs, sizes)]
    embeds, mask, slots = pipe.encode_prompt(prompt=example.caption, image=resized, device=torch.device("cpu"))
    assert mask is None
    assert torch.equal(item["prompt_embeds"], embeds[0]) and torch.equal(item["prompt_slots"], slots[0])
    vae_images = [pipe.image_processor.preprocess(r, width=w, height=h).unsqueeze(2) for r, (w, h) in zip(refs, sizes)]
    _, rows, cols = item["img_shapes"][0].tolist()
    th, tw = 16 * rows, 16 * cols
    _, ref_latents = pipe.prepare_latents(vae_images, 1, 64, th, tw, torch.float32, torch.device("cpu"), None)
    ours = torch.cat([pipe._pack_latents(item[f"control_latents_{i}"][None], 1, 64, *item[f"control_latents_{i}"]
                                         .shape[-2:]) for i in range(3)], dim=1)
    assert ours.shape == ref_latents.shape  # the same VAE; the latents' normalisation and packing in another order
    assert_close_fp32(ours, ref_latents, ops=TINY_VAE_ROUNDINGS, what="cached reference latents vs the pipeline's")
    batch = collate([item], [sample_generator(3, 0, 0, 0)], caption_dropout=0.0, control_dropout=0.0,
                    device=torch.device("cpu"), dtype=torch.float32)
    pred, velocity, token_mask, sigma = predict(comps.transformer, batch, config, comps.scheduler_config)
    assert token_mask is None
    # the noisy target the step made: sigma * noise + (1 - sigma) * x0, and noise - x0 = velocity
    x0 = batch.targets[0]
    noisy = (1 - sigma) * x0 + sigma * (velocity[0] + x0)
    n = x0.shape[0]
    img_mask = torch.cat([slots, torch.ones(1, n // 4, dtype=torch.bool)], dim=1)
    shapes = [[*[(1, h // 16, w // 16) for w, h in sizes], (1, th // 16, tw // 16)]]
    with torch.no_grad():
        expected = pipe.transformer(hidden_states=torch.cat([ref_latents, noisy[None]], dim=1), timestep=sigma,
                                    encoder_hidden_states=embeds, encoder_hidden_states_mask=None, img_shapes=shapes,
                                    img_mask=img_mask, return_dict=False)[0][:, -n:]
    assert_close_fp32(pred, expected, ops=TINY_FORWARD_ROUNDINGS, what="training prediction vs the pipeline's")


def test_our_prompt_encoding_takes_the_layer_before_the_final_norm(tiny_21_dir):
    """transformers 5 ties `hidden_states[-1]` to the normed last hidden state; the pipeline (and we) read the
    last decoder layer's output before the norm. Ours equals the pipeline's `encode_prompt` and that layer, not
    the normed one."""
    from qwen_edit_core.families.qwen_image_21 import encode as encode21
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    comps = load_components(tiny_21_dir, DevicePlan.from_mapping({}), which=("text_encoder", "vae", "transformer"))
    te, pipe = comps.text_encoder, _pipeline(comps)
    refs = [Image.new("RGB", (64, 32), (200, 30, 40)), Image.new("RGB", (32, 64), (10, 90, 240))]
    ours = encode21.encode_prompt(te.model, te.processor, "swap them", refs, device=torch.device("cpu"))
    theirs = pipe.encode_prompt(prompt="swap them", image=refs, device=torch.device("cpu"))[0]
    assert torch.equal(ours.embeds, theirs)
    language = te.model.model.language_model
    captured = {}
    handle = language.norm.register_forward_hook(lambda m, args, out: captured.update(pre=args[0], post=out))
    text, _ = encode21.variants.IMAGE_21.format_prompt("swap them", 2)
    inputs = te.processor(text=[text], images=[encode21.over_white(r) for r in refs], return_tensors="pt")
    try:
        with torch.no_grad():
            normed = te.model(**inputs, output_hidden_states=True).hidden_states[-1]
    finally:
        handle.remove()
    drop = encode21.system_tokens(te.processor)
    assert torch.equal(normed, captured["post"])  # what transformers 5 returns there
    assert torch.equal(ours.embeds[0], captured["pre"][0, drop:])
    assert (ours.embeds[0] - captured["post"][0, drop:]).abs().max() > 1e-2


def test_a_2509_entry_is_never_used_for_21(tiny_21_dir, tiny_plus_dir, simple_dir, tmp_path):
    """Same pair, same cache folder: the 2.1 key differs from the 2509 key (its own family field and encoding),
    and a 2509 entry's file put under the 2.1 entry's name is rejected as stale and recomputed."""
    import shutil
    config = train_config(tiny_plus_dir, simple_dir, tmp_path / "plus", cache_dir=tmp_path / "cache",
                          data={"vl_area": SIDE * SIDE})
    plus = QwenImageEditTrainer(config)
    example = plus.dataset().examples[0]
    plus.cache([example])
    plus_key = cache_key(example, plus.encode_settings("edit-plus"), encoder_identity(tiny_plus_dir))
    same_identity = cache_key(example, plus.encode_settings("image-2.1"), encoder_identity(tiny_plus_dir))
    assert same_identity.family == "qwen-image-2.1" and plus_key.family == ""
    assert same_identity.digest() != plus_key.digest()
    cache = plus._cache()
    target = cache.path_for(same_identity)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(cache.path_for(plus_key), target)
    assert cache.get(same_identity) is None and not target.exists()
    from qwen_edit_core.data.cache_tensors import check_tensors
    stored = cache.get(plus_key)
    problem = check_tensors(same_identity.__class__(**{**same_identity.__dict__, "control_buckets":
                                                       plus_key.control_buckets}), stored)
    assert problem is not None and "prompt_slots" in problem


def test_cached_and_realtime_training_are_equal(tiny_21_dir, refs_dir, tmp_path):
    sections = {"train": {"max_steps": 3}, "data": {"batch_size": 3}}
    cached = QwenImageEditTrainer(train_config(tiny_21_dir, refs_dir, tmp_path / "c", **sections)).fit()
    realtime = QwenImageEditTrainer(train_config(tiny_21_dir, refs_dir, tmp_path / "r", cache={"enabled": False},
                                                 **sections)).fit()
    assert [s for s, _ in cached.history] == [1, 2, 3]
    # the cache holds the float32 tensors the realtime path encodes: the same steps, bit for bit
    assert cached.history == realtime.history
    a, b = load_file(cached.lora_path), load_file(realtime.lora_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mixed_reference_counts_batch_equals_one_by_one(tiny_21_dir, refs_dir, tmp_path):
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.train.batch import collate, flow_loss, sample_generator
    from qwen_edit_core.families.qwen_image_21.batch import layout_groups
    config, trainer, _, items = _items(tiny_21_dir, refs_dir, tmp_path / "o")
    assert [len(i["img_shapes"]) - 1 for i in items] == [1, 2, 3]
    model, sched = trainer.components.transformer, trainer.components.scheduler_config
    torch.manual_seed(0)
    lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=("to_q", "to_k", "to_v", "to_out.0",
                                                                      "img_mlp.proj", "img_mlp.gate_layer",
                                                                      "img_mlp.out"), init="gaussian"))
    with torch.no_grad():
        for layer in lora.adapter_layers(model).values():
            layer.lora_B["default"].weight.normal_(0, 0.02)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    gens = lambda: [sample_generator(2, 0, 0, j) for j in range(3)]  # noqa: E731
    kw = dict(caption_dropout=0.0, control_dropout=0.0, device=torch.device("cpu"), dtype=torch.float32)
    batch = collate(items, gens(), **kw)
    assert len(layout_groups(batch)) == 3
    loss, per_sample = flow_loss(model, batch, config, sched)
    loss.backward()
    batch_grads = {n: p.grad.clone() for n, p in params.items()}
    alone, grads = [], {n: torch.zeros_like(p) for n, p in params.items()}
    for item, gen in zip(items, gens()):
        model.zero_grad(set_to_none=True)
        single = flow_loss(model, collate([item], [gen], **kw), config, sched)[0]
        single.backward()
        alone.append(single.item())
        for n, p in params.items():
            grads[n] += p.grad / 3
    # one call per layout instead of one per sample: other kernels' sums, a forward's roundings (doubled by the
    # squared error); the gradients: the backward (about twice the forward's) and the three samples' sum
    assert_close_fp32(per_sample, torch.tensor(alone), ops=2 * TINY_FORWARD_ROUNDINGS, what="per-sample losses")
    scale = max(g.abs().max().item() for g in grads.values())  # the gradients' size, over all of them
    error, allowed = max_abs_diff(batch_grads, grads), fp32_tolerance(scale, ops=2 * TINY_FORWARD_ROUNDINGS + 3)
    assert scale > 0 and error <= allowed, f"gradients batched vs one by one: {error:.3e} > allowed {allowed:.3e}"
    # two samples of one layout share one call and still equal one by one
    twin = collate([items[0], items[0]], [sample_generator(2, 0, 0, j) for j in range(2)], **kw)
    assert len(layout_groups(twin)) == 1
    with torch.no_grad():
        _, pair = flow_loss(model, twin, config, sched)
        solo = [flow_loss(model, collate([items[0]], [sample_generator(2, 0, 0, j)], **kw), config, sched)[0].item()
                for j in range(2)]
    assert_close_fp32(pair, torch.tensor(solo), ops=2 * TINY_FORWARD_ROUNDINGS, what="losses of a pair vs alone")


def test_caption_and_reference_dropout(tiny_21_dir, refs_dir, tmp_path):
    from qwen_edit_core.train.batch import collate, sample_generator
    _, _, _, items = _items(tiny_21_dir, refs_dir, tmp_path / "o")
    kw = dict(device=torch.device("cpu"), dtype=torch.float32)
    item = items[1]
    dropped = collate([item], [sample_generator(0, 0, 0, 0)], caption_dropout=1.0, control_dropout=1.0, **kw)
    kept = collate([item], [sample_generator(0, 0, 0, 0)], caption_dropout=0.0, control_dropout=0.0, **kw)
    assert torch.equal(dropped.embeds[0], item["empty_prompt_embeds"])
    assert torch.equal(kept.embeds[0], item["prompt_embeds"])
    n_slots = item["target_latents"].shape[-1] * item["target_latents"].shape[-2] // 4
    assert torch.equal(dropped.slots[0][:-n_slots], item["empty_prompt_slots"])
    # the empty caption still holds both references' vision slots (same count as the caption's)
    assert int(item["empty_prompt_slots"].sum()) == int(item["prompt_slots"].sum()) > 0
    assert dropped.references[0].abs().max() == 0 and kept.references[0].abs().max() > 0


def test_pixel_aligned_references_take_the_targets_size(tiny_21_dir, refs_dir, tmp_path):
    _, _, _, items = _items(tiny_21_dir, refs_dir, tmp_path / "o", data={"control_size": "target"})
    for item in items:
        shapes = item["img_shapes"].tolist()
        assert all(s == shapes[0] for s in shapes)


def test_region_mask_weights_the_loss(tiny_21_dir, tmp_path):
    """mask_weight 1, unmasked_weight 0: the loss is the squared error over the masked (left) half only."""
    from qwen_edit_core.train.batch import collate, flow_loss, predict, sample_generator
    data = make_ref_pairs(tmp_path / "d", counts=(1,), mask=True)
    config, trainer, _, items = _items(tiny_21_dir, data, tmp_path / "o",
                                       train={"mask_weight": 1.0, "unmasked_weight": 0.0})
    item = items[0]
    _, rows, cols = item["img_shapes"][0].tolist()
    grid = item["loss_mask"].reshape(rows, cols)
    assert cols % 2 == 0 and grid[:, : cols // 2].min() == 1 and grid[:, cols // 2:].max() == 0
    comps = trainer.components
    kw = dict(caption_dropout=0.0, control_dropout=0.0, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        loss = flow_loss(comps.transformer, collate([item], [sample_generator(1, 0, 0, 0)], **kw), config,
                         comps.scheduler_config)[0]
        pred, target, _, _ = predict(comps.transformer, collate([item], [sample_generator(1, 0, 0, 0)], **kw),
                                     config, comps.scheduler_config)
    err = (pred - target).square().mean(-1)[0] * item["loss_mask"]
    # the same squares, their mean over 64 channels and the masked mean over the tokens, summed in another order
    assert_close_fp32(loss, err.sum() / err.numel(), ops=64 + err.numel(), what="masked loss vs by hand")


@pytest.mark.parametrize("kind", [{"type": "lokr"}, {"type": "loha"}, {"dora": True}])
def test_adapter_kinds_train_on_21(tiny_21_dir, simple_dir, tmp_path, kind):
    result = QwenImageEditTrainer(train_config(tiny_21_dir, simple_dir, tmp_path / "o", model={
        "pretrained_model_name_or_path": str(tiny_21_dir), "lora": {"rank": 4, "alpha": 4.0, "targets": "all", **kind}},
        train={"max_steps": 2})).fit()
    assert result.step == 2 and all(np.isfinite(v) for _, v in result.history)
    assert any(k.startswith("transformer_blocks.0.img_mlp.gate_layer.") for k in load_file(result.lora_path))


def test_stop_and_resume_with_ema_equals_uninterrupted(tiny_21_dir, refs_dir, tmp_path):
    sections = {"train": {"max_steps": 4, "checkpoint_every": 2, "ema_decay": 0.9},
                "data": {"caption_dropout_rate": 0.3, "prompt_image_dropout_rate": 0.3, "batch_size": 2}}
    full = QwenImageEditTrainer(train_config(tiny_21_dir, refs_dir, tmp_path / "full", **sections)).fit()
    token = CancelToken()

    def stop_at_2(event):
        if event.stage == "train" and event.step == 2:
            token.cancel()

    config = train_config(tiny_21_dir, refs_dir, tmp_path / "stopped", **sections)
    stopped = QwenImageEditTrainer(config).fit(progress=stop_at_2, cancel=token)
    assert stopped.state == "cancelled" and stopped.step == 2
    resumed = QwenImageEditTrainer(config).fit(resume=True)
    assert resumed.step == 4
    for name in ("lora.safetensors", "lora_ema.safetensors"):
        a, b = load_file(tmp_path / "full" / name), load_file(tmp_path / "stopped" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name  # the same steps
    ema, plain = load_file(tmp_path / "full" / "lora_ema.safetensors"), load_file(full.lora_path)
    assert max((ema[k] - plain[k]).abs().max().item() for k in ema) > 0


@pytest.mark.parametrize("cached", [True, False])
def test_validation_previews_with_a_sigma_list(tiny_21_dir, simple_dir, tmp_path, cached):
    """Validation samples the 2.1 validation input with the 2.1 sampler in each preview (one of them the DMD
    6-step sigma preset at its CFG 1); the latents equal the 2.1 sampler's for the same references and prompt, and
    the labelled grid is decoded."""
    from safetensors import safe_open

    from qwen_edit_core.sample import sampler
    from qwen_edit_core.families.qwen_image_21 import sampler as sampler21
    out = tmp_path / "o"
    image = simple_dir / "p0_control.png"
    config = train_config(tiny_21_dir, simple_dir, out, cache={"enabled": cached}, predict={"true_cfg_scale": 1.0},
                          train={"max_steps": 2, "validation_every": 2, "validation_steps": 2,
                                 "validation_image": str(image), "validation_prompt": "invert the colors",
                                 "validation_previews": [{"schedule": "diffusers"},
                                                         {"sigmas": "qwen21-dmd-6step"}]})
    trainer = QwenImageEditTrainer(config)
    result = trainer.fit()
    assert [p.name for p in result.validation_images] == ["step-0000002.png"]
    latents = load_file(out / "validation" / "step-0000002.safetensors")
    with safe_open(out / "validation" / "step-0000002.safetensors", "pt") as f:
        assert f.metadata()["labels"] == '["diffusers 2 steps, CFG 1", "sigmas qwen21-dmd-6step, CFG 1"]'
    trainer.load_model(keep_transformer=True)
    comps = trainer.components
    refs = [Image.open(image).convert("RGB")]
    for i, settings in enumerate([sampler.SampleSettings(num_inference_steps=2, true_cfg_scale=1.0, seed=3,
                                                         vae_area=SIDE * SIDE),
                                  sampler.SampleSettings(true_cfg_scale=1.0, seed=3, vae_area=SIDE * SIDE,
                                                         sigmas=(1.0, 0.9375, 0.875, 0.75, 0.5, 0.25))]):
        cond = sampler21.build_conditioning(comps, "invert the colors", refs, settings)
        expected = sampler21.denoise(comps, cond, settings)
        steps = len(settings.sigmas) if settings.sigmas else settings.num_inference_steps
        # the LoRA beside the weights in training vs loaded again: one forward's roundings per step
        assert_close_fp32(latents[f"latents_{i}"], expected, ops=steps * TINY_FORWARD_ROUNDINGS,
                          what=f"validation latents {i} vs sampled again")


def _run(model_dir, data, out, **train):
    config = train_config(model_dir, data, out, cache_dir=out.parent / "cache", train={"max_steps": 2, **train},
                          logging={"plot": False})
    return QwenImageEditTrainer(config).fit()


def _lora_diff(a, b) -> float:
    a, b = load_file(a), load_file(b)
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_checkpointing_and_offload_over_21_blocks_train_the_same(tiny_21_dir, refs_dir, tmp_path):
    """Every block or one block (train.checkpoint_blocks) recomputed, one block offloaded: the same LoRA."""
    plain = _run(tiny_21_dir, refs_dir, tmp_path / "plain")
    every = _run(tiny_21_dir, refs_dir, tmp_path / "every", gradient_checkpointing=True)
    one = _run(tiny_21_dir, refs_dir, tmp_path / "one", gradient_checkpointing=True, checkpoint_blocks=1,
               offload_blocks=1)
    # recomputing a block runs its forward again with the same kernels; offloading moves exact copies
    assert _lora_diff(plain.lora_path, every.lora_path) == 0
    assert _lora_diff(plain.lora_path, one.lora_path) == 0


def test_training_21_loads_its_transformer_in_the_plan_it_made_before_loading(tiny_21_dir, refs_dir, tmp_path):
    """Qwen-Image-2.1 takes the same path: `fit` plans fp8, an offloaded block and checkpointing before any weight
    is read, and its transformer is streamed straight into that plan, which the levers then apply."""
    from diffusers import QwenImage21Transformer2DModel

    from qwen_edit_core import speed
    trainer = QwenImageEditTrainer(train_config(tiny_21_dir, refs_dir, tmp_path / "o", train={
        "max_steps": 1, "fp8_base": True, "gradient_checkpointing": True, "offload_blocks": 1}))
    assert trainer.fit().state == "done"
    transformer = trainer.components.transformer
    assert isinstance(transformer, QwenImage21Transformer2DModel)
    plan = speed.loaded_plan(transformer)
    assert plan is not None and plan.fp8 and plan.offloaded == (1,) and plan.checkpoint_blocks == -1
    assert speed.has_fp8(transformer) and sorted(transformer._qwen_edit_offloader.slots) == [1]


def test_fp8_base_over_21_blocks_trains_close_to_the_full_precision_base(tiny_21_dir, refs_dir, tmp_path):
    """The block linears in fp8 (e4m3 with a per-tensor scale): the trained LoRA's up-projections stay within 0.3
    (relative) of the full-precision run's, as on the 2025 family."""
    plain = _run(tiny_21_dir, refs_dir, tmp_path / "plain", max_steps=3)
    fast = _run(tiny_21_dir, refs_dir, tmp_path / "fp8", max_steps=3, fp8_base=True)
    x, ref = load_file(fast.lora_path), load_file(plain.lora_path)
    ups = [k for k in ref if "lora_up" in k]
    a, b = torch.cat([x[k].flatten() for k in ups]), torch.cat([ref[k].flatten() for k in ups])
    assert 0 < (a - b).norm() / b.norm() < 0.3  # measured: 0.14


@pytest.mark.slow  # inductor compiles the 2.1 block
def test_compiled_21_blocks_train_the_same(tiny_21_dir, tmp_path):
    """One pair with three references of their own sizes: both blocks' graphs (the first block's inputs need no
    gradient, the second's do) compile once and serve both steps. One pair, not `refs_dir`'s three: each other
    reference count is another list of attention segments, so both graphs again (minutes of CPU compiling)."""
    from qwen_edit_core import speed
    data = make_ref_pairs(tmp_path / "three", counts=(3,))
    plain = _run(tiny_21_dir, data, tmp_path / "plain")
    config = train_config(tiny_21_dir, data, tmp_path / "compiled", cache_dir=tmp_path / "cache",
                          train={"max_steps": 2, "compile": True}, logging={"plot": False})
    trainer = QwenImageEditTrainer(config)
    compiled = trainer.fit()
    stats = speed.compile_stats(trainer.components.transformer)
    assert stats is not None and stats.fallback is None and stats.blocks == 2 and stats.graphs == 2, stats
    # inductor fuses and reorders each step's forward and backward; the rounding of a step's gradients moves the
    # weights the next step starts from, so step k's loss carries the rounding of k steps
    for step, ((_, a), (_, b)) in enumerate(zip(compiled.history, plain.history), 1):
        assert_close_fp32(torch.tensor(a), torch.tensor(b), ops=tiny_training_roundings(step),
                          what=f"compiled vs eager 2.1 loss at step {step}")
    expected = load_file(plain.lora_path)
    assert_close_fp32(load_file(compiled.lora_path), expected, ops=tiny_training_roundings(2),
                      size=adam_trained_size(expected, lr=config.optimizer.lr),
                      what="compiled vs eager 2.1 LoRA after 2 steps")


def test_the_planner_reads_the_real_21_transformer_and_plans_24_gb():
    """The real 2.1 transformer (32 blocks, 4096 wide, on the meta device) with an r16 LoRA on the "all" preset: the
    planner counts its blocks and plans a 1024^2 edit with one reference (4,096 target + 4,096 reference + about
    100 text tokens) into 24 GiB; 7 B bf16 weights (about 14 GiB) fit without offloading."""
    from diffusers import QwenImage21Transformer2DModel

    from qwen_edit_core import speed
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.families import QWEN_IMAGE_21
    from qwen_edit_core.families.qwen_image_21.tiny import transformer_config
    with torch.device("meta"):
        model = QwenImage21Transformer2DModel(**transformer_config("real")).to(torch.bfloat16)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        lora.inject_lora(model, lora.LoraSpec(rank=16, alpha=16, targets=QWEN_IMAGE_21.lora_targets["all"]))
    sizes = speed.model_sizes(model)
    assert sizes["n_blocks"] == 32 and sizes["dim"] == 4096
    weights = (32 * sizes["block_params"] + sizes["other_params"]) * 2
    assert 6.5e9 * 2 < weights < 8e9 * 2
    plan = speed.plan_for_budget(24, tokens=4096 * 2 + 100, **sizes)
    assert plan.estimate.total <= 24 * 2**30 and plan.offload_blocks == 0


def test_cli_tiny_cache_train_and_sample_a_21_lora(refs_dir, tmp_path):
    """`qwen-edit tiny --variant image-2.1`, then `cache` and `train` on a dataset of 1 to 3 references per pair; the
    second `cache` reuses every entry; the trained LoRA samples with `qwen-edit sample`."""
    import yaml

    from qwen_edit_core.cli import main
    model = tmp_path / "tiny21"
    assert main(["tiny", str(model), "--variant", "image-2.1", "--seed", "2"]) == 0
    out = tmp_path / "o"
    cfg = {"model": {"pretrained_model_name_or_path": str(model), "lora": {"rank": 4, "targets": "all"}},
           "data": {"folder": str(refs_dir), "vae_area": SIDE * SIDE, "batch_size": 3},
           "cache": {"dir": str(tmp_path / "cache")}, "train": {"output_dir": str(out), "max_steps": 2}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["cache", str(path)]) == 0
    entries = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(entries) == 3
    assert main(["cache", str(path)]) == 0 and sorted((tmp_path / "cache").rglob("*.safetensors")) == entries
    assert main(["train", str(path)]) == 0
    lora_file = out / "lora.safetensors"
    assert load_file(lora_file) and any(".img_mlp.gate_layer." in k for k in load_file(lora_file))
    picture = tmp_path / "edit.png"
    assert main(["sample", "--model", str(model), "--image", str(refs_dir / "r2_control_1.png"), "--image",
                 str(refs_dir / "r2_control_2.png"), "--prompt", "combine them", "--lora", str(lora_file),
                 "--steps", "2", "--vae-area", str(SIDE * SIDE), "--out", str(picture)]) == 0
    assert Image.open(picture).mode == "RGBA"


def _launch(config: dict, tmp_path, *args: str, tail: tuple[str, ...] = ()):
    import os
    import subprocess
    import sys

    import yaml
    path = tmp_path / f"c{len(list(tmp_path.glob('c*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([accelerate, "launch", *args, "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "qwen_edit_core.cli", "train",
                           str(path), *tail], capture_output=True, text=True, timeout=900, env=env)


def _pairs_for_two_processes(folder):
    """Four pairs, 1, 2, 1, 2 references (64x64), captions of four lengths: full batches of 2 in each bucket."""
    rng = np.random.default_rng(5)
    folder.mkdir(parents=True)
    for n, k in enumerate((1, 2, 1, 2)):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"q{n}.png")
        for i in range(1, k + 1):
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"q{n}_control_{i}.png")
        (folder / f"q{n}.txt").write_text("combine " + "them " * (n + 1))
    return folder


def _cfg(model_dir, data_dir, out, cache) -> dict:
    return {"model": {"pretrained_model_name_or_path": str(model_dir), "lora": {"rank": 4, "alpha": 4.0, "targets": "all"}},
            "data": {"folder": str(data_dir), "vae_area": SIDE * SIDE, "batch_size": 2},
            "cache": {"dir": str(cache)}, "train": {"output_dir": str(out), "max_steps": 3, "seed": 3},
            "optimizer": {"lr": 1e-3}}


@pytest.mark.slow  # accelerate launch: two processes
def test_data_parallel_two_processes_equal_one_process(tiny_21_dir, tmp_path):
    """Two CPU processes (each its share of a global batch of 2 pairs, captions of different lengths) train the
    LoRA of one process bit for bit: the 2.1 model is not DDP-wrapped (one forward per token layout, in one
    process as in two), its LoRA gradients are averaged once per step."""
    refs_dir = _pairs_for_two_processes(tmp_path / "pairs")
    proc = _launch(_cfg(tiny_21_dir, refs_dir, tmp_path / "ddp", tmp_path / "cache"), tmp_path, "--multi_gpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training on 2 processes (data parallel)" in proc.stderr
    single = QwenImageEditTrainer(train_config(tiny_21_dir, refs_dir, tmp_path / "one", cache_dir=tmp_path / "cache",
                                               train={"max_steps": 3, "seed": 3})).fit()
    # One process runs one forward per pair too (one per token layout), and the average of two gradients rounds
    # the same in either order: the same arithmetic, bit for bit
    assert _lora_diff(single.lora_path, tmp_path / "ddp" / "lora.safetensors") == 0.0


@pytest.mark.slow  # accelerate launch: two processes
def test_fsdp_two_processes_equal_one_process_and_resume_exactly(tiny_21_dir, tmp_path):
    """FSDP2 over two CPU processes (examples/fsdp2.yaml: each 2.1 block its own unit) trains the LoRA of one
    process bit for bit, and resuming its step-2 checkpoint gives the same LoRA."""
    from pathlib import Path
    fsdp = str(Path(__file__).resolve().parents[2] / "examples" / "fsdp2.yaml")
    refs_dir = _pairs_for_two_processes(tmp_path / "pairs")
    cfg = _cfg(tiny_21_dir, refs_dir, tmp_path / "fsdp", tmp_path / "cache")
    cfg["train"].update(max_steps=4, checkpoint_every=2)
    full = _launch(cfg, tmp_path, "--config_file", fsdp)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "FSDP: frozen base sharded over 2 processes" in full.stderr
    single = QwenImageEditTrainer(train_config(tiny_21_dir, refs_dir, tmp_path / "one", cache_dir=tmp_path / "cache",
                                               train={"max_steps": 4, "seed": 3})).fit()
    # bit for bit, as in test_data_parallel_two_processes_equal_one_process (the sharded base's blocks compute
    # the same sums once gathered)
    assert _lora_diff(single.lora_path, tmp_path / "fsdp" / "lora.safetensors") == 0.0
    cfg["train"]["output_dir"] = str(tmp_path / "resumed")
    step2 = tmp_path / "fsdp" / "checkpoints" / "step-0000002"
    resumed = _launch(cfg, tmp_path, "--config_file", fsdp, tail=("--resume", str(step2)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _lora_diff(tmp_path / "fsdp" / "lora.safetensors", tmp_path / "resumed" / "lora.safetensors") == 0.0


def test_preview_sigma_lists_from_the_config_and_preview_lines():
    """A preview's `sigmas` (a preset or a list) sets its steps (the list's length) and, for a preset, its CFG; a
    preview line takes `sigmas=PRESET` or `sigmas=1,0.5`; a rising list is named."""
    from qwen_edit_core import load_config
    from qwen_edit_core.train.validation import parse_previews, previews_from_config
    config = load_config(overrides={"predict": {"true_cfg_scale": 4.0}, "train": {"validation_previews": [
        {"sigmas": "qwen21-dmd-6step"}, {"sigmas": [1.0, 0.6, 0.3]}, {"sigmas": [1.0, 0.5], "cfg": 2.5}]}})
    preset, listed, given = previews_from_config(config)
    assert preset.settings.sigmas == (1.0, 0.9375, 0.875, 0.75, 0.5, 0.25)
    assert (preset.settings.num_inference_steps, preset.settings.true_cfg_scale) == (6, 1.0)
    assert preset.label == "sigmas qwen21-dmd-6step, CFG 1"
    assert listed.settings.sigmas == (1.0, 0.6, 0.3) and listed.settings.true_cfg_scale == 4.0
    assert listed.label == "diffusers 3 steps (sigma list), CFG 4"
    assert given.settings.true_cfg_scale == 2.5
    assert parse_previews(["diffusers sigmas=qwen21-dmd-6step", "diffusers sigmas=1,0.5"]) == [
        {"schedule": "diffusers", "loras": [], "sigmas": "qwen21-dmd-6step"},
        {"schedule": "diffusers", "loras": [], "sigmas": (1.0, 0.5)}]
    with pytest.raises(ValueError, match="sigmas '0.5,1' is not a preset"):
        parse_previews(["diffusers sigmas=0.5,1"])


def test_more_references_than_21_takes_are_named_before_any_weight_loads(tiny_21_dir, tmp_path):
    from qwen_edit_core.data.dataset import DatasetError
    folder = tmp_path / "eleven"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(1, 12):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"a_control_{i}.png")
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / "a.png")
    (folder / "a.txt").write_text("x")
    with pytest.raises(DatasetError, match="has 11 control images; a Qwen-Image-2.1 model takes at most 10"):
        QwenImageEditTrainer(train_config(tiny_21_dir, folder, tmp_path / "o")).dataset()


def test_held_out_pairs_are_sampled_with_the_21_sampler(tiny_21_dir, refs_dir, tmp_path):
    result = QwenImageEditTrainer(train_config(tiny_21_dir, refs_dir, tmp_path / "o", predict={"true_cfg_scale": 1.0},
                                               train={"max_steps": 2, "validation_every": 2, "validation_pairs": 1,
                                                      "validation_steps": 2})).fit()
    (row,) = result.validation_metrics
    assert row[0] == 2 and all(np.isfinite(v) for v in row[1:3])
    assert len(list((tmp_path / "o" / "validation" / "heldout" / "step-0000002").glob("*.png"))) == 1
