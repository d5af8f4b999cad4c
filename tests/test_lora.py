"""LoRA files: keys stock ComfyUI loads with the same effect, diffusers round trip, other layouts, bad files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from qwen_edit_core import lora, sampler
from qwen_edit_core.components import load_components, load_transformer
from qwen_edit_core.devices import DevicePlan


def _trained(model_dir, targets="all", rank=4, alpha=8.0, seed=0):
    """A transformer with a LoRA whose B matrices are non-zero (as after training)."""
    transformer = load_transformer(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    spec = lora.LoraSpec(rank=rank, alpha=alpha, targets=lora.resolve_targets(targets))
    torch.manual_seed(seed)
    lora.inject_lora(transformer, spec)
    with torch.no_grad():
        for layer in lora.adapter_layers(transformer).values():
            layer.lora_B["default"].weight.normal_(0, 0.05)
    return transformer, spec


def _comfy_accepted_keys(module_paths):
    """The keys stock ComfyUI's LoRA loader (comfy/lora.py) maps to each Qwen-Image module path P
    (FACTS.md §3): prefixes diffusion_model.P, P, transformer.P, lora_unet_P_, lycoris_P_ (not
    model.diffusion_model.P)."""
    accepted = {}
    for p in module_paths:
        for key in (f"diffusion_model.{p}", p, f"transformer.{p}", "lora_unet_" + p.replace(".", "_"),
                    "lycoris_" + p.replace(".", "_")):
            accepted[key] = p
    return accepted


def _comfy_apply(state, accepted):
    """What ComfyUI does with a file: per accepted base key, W += (alpha/rank if .alpha else 1) * up @ down;
    returns (deltas by module path, keys it did not load)."""
    deltas, used = {}, set()
    for base, path in accepted.items():
        for up_s, down_s in ((".lora_up.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_A.weight")):
            if base + up_s in state and base + down_s in state:
                up, down = state[base + up_s].float(), state[base + down_s].float()
                alpha = state.get(base + ".alpha")
                scale = alpha.item() / down.shape[0] if alpha is not None else 1.0
                deltas[path] = scale * up @ down
                used |= {base + up_s, base + down_s} | ({base + ".alpha"} if alpha is not None else set())
    return deltas, sorted(set(state) - used)


def test_saved_keys_load_fully_in_stock_comfyui_with_the_same_effect(tiny_edit_dir, tmp_path):
    transformer, spec = _trained(tiny_edit_dir)
    path = lora.save_lora(tmp_path / "l.safetensors", transformer, spec, base_identity="tiny", steps=7)
    state = load_file(path)
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in state)
    fresh = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    paths = [n for n, m in fresh.named_modules() if isinstance(m, torch.nn.Linear)]
    deltas, not_loaded = _comfy_apply(state, _comfy_accepted_keys(paths))
    assert not_loaded == []  # ComfyUI would log "lora key not loaded" for any of these
    assert len(deltas) == len(lora.adapter_layers(transformer)) == 2 * 12
    for path_, layer in lora.adapter_layers(transformer).items():
        peft_delta = layer.get_delta_weight("default")
        assert torch.allclose(deltas[path_], peft_delta, atol=1e-6)


def test_metadata_and_atomic_write(tiny_edit_dir, tmp_path):
    transformer, spec = _trained(tiny_edit_dir, targets="attn")
    path = lora.save_lora(tmp_path / "l.safetensors", transformer, spec, base_identity="tiny-id", steps=12)
    meta = lora.read_lora_file(path).metadata
    assert meta["rank"] == "4" and meta["alpha"] == "8.0" and meta["base_identity"] == "tiny-id"
    assert meta["steps"] == "12" and "to_add_out" in meta["targets"]
    assert [p.name for p in tmp_path.iterdir()] == ["l.safetensors"]


def _output(transformer, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 32, 64, generator=g)
    text = torch.randn(1, 7, 32, generator=g)
    with torch.no_grad():
        return transformer(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.5]),
                           img_shapes=[[(1, 4, 4), (1, 4, 4)]], return_dict=False)[0]


@pytest.mark.parametrize("layout", ["comfy", "peft", "peft-transformer", "peft-default", "kohya", "bare-alpha"])
def test_every_layout_reads_back_to_the_same_effect(tiny_edit_dir, tmp_path, layout):
    transformer, spec = _trained(tiny_edit_dir)
    expected = _output(transformer)
    comfy = lora.lora_state_dict_comfy(transformer, spec.alpha)
    scale = spec.alpha / spec.rank
    state = {}
    for key, value in comfy.items():
        p = key.removeprefix("diffusion_model.")
        module, _, kind = p.rpartition(".lora_") if ".lora_" in p else (p.removesuffix(".alpha"), "", "alpha")
        if layout == "comfy":
            state[key] = value
        elif layout == "kohya":
            state["lora_unet_" + module.replace(".", "_") + ("." + ("lora_" + kind) if kind != "alpha" else ".alpha")
                  ] = value
        elif layout == "bare-alpha":
            state[p] = value
        elif kind != "alpha":
            # peft/diffusers files carry no alpha: the scale is folded into B.
            name = {"down.weight": "lora_A", "up.weight": "lora_B"}[kind]
            tensor = value * scale if name == "lora_B" else value
            prefix = {"peft": "", "peft-transformer": "transformer.", "peft-default": "base_model.model."}[layout]
            suffix = ".default.weight" if layout == "peft-default" else ".weight"
            state[f"{prefix}{module}.{name}{suffix}"] = tensor
    save_file(state, tmp_path / "x.safetensors")
    fresh = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    lora.load_lora_into(fresh, lora.read_lora_file(tmp_path / "x.safetensors"), adapter_name="x")
    assert torch.allclose(_output(fresh), expected, atol=1e-5)


def test_strength_and_two_loras(tiny_edit_dir, tmp_path):
    a, spec = _trained(tiny_edit_dir, seed=1)
    pa = lora.save_lora(tmp_path / "a.safetensors", a, spec, base_identity="t", steps=1)
    b, spec = _trained(tiny_edit_dir, seed=2)
    pb = lora.save_lora(tmp_path / "b.safetensors", b, spec, base_identity="t", steps=1)
    base = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    out0 = _output(base)
    lora.load_lora_into(base, lora.read_lora_file(pa), adapter_name="a", strength=0.0)
    assert torch.allclose(_output(base), out0, atol=1e-6)
    both = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    lora.load_lora_into(both, lora.read_lora_file(pa), adapter_name="a", strength=0.5)
    lora.load_lora_into(both, lora.read_lora_file(pb), adapter_name="b", strength=1.0)
    # Linear layers: the deltas add, so the combined weight is W + 0.5 dA + dB.
    merged = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    wa, wb = lora.read_lora_file(pa), lora.read_lora_file(pb)
    with torch.no_grad():
        for name, module in merged.named_modules():
            if name in wa.layers:
                module.weight += 0.5 * lora.lora_delta(wa, name) + lora.lora_delta(wb, name)
    assert torch.allclose(_output(both), _output(merged), atol=1e-5)
    lora.merge_lora(both)
    assert torch.allclose(_output(both), _output(merged), atol=1e-5)
    lora.unmerge_lora(both)
    assert torch.allclose(_output(both), _output(merged), atol=1e-5)


def test_bad_files_are_named(tiny_edit_dir, tmp_path):
    transformer = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    save_file({"some.weird.key": torch.zeros(2)}, tmp_path / "u.safetensors")
    with pytest.raises(ValueError, match="no known LoRA layout"):
        lora.read_lora_file(tmp_path / "u.safetensors")
    save_file({"diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight": torch.zeros(4, 32)},
              tmp_path / "half.safetensors")
    with pytest.raises(ValueError, match="no up"):
        lora.read_lora_file(tmp_path / "half.safetensors")
    save_file({"diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight": torch.zeros(4, 3072),
               "diffusion_model.transformer_blocks.0.attn.to_q.lora_up.weight": torch.zeros(3072, 4)},
              tmp_path / "big.safetensors")
    with pytest.raises(ValueError, match="another model"):
        lora.load_lora_into(transformer, lora.read_lora_file(tmp_path / "big.safetensors"))
    save_file({"diffusion_model.single_blocks.0.linear.lora_down.weight": torch.zeros(4, 32),
               "diffusion_model.single_blocks.0.linear.lora_up.weight": torch.zeros(32, 4)},
              tmp_path / "flux.safetensors")
    with pytest.raises(ValueError, match="no such module"):
        lora.load_lora_into(transformer, lora.read_lora_file(tmp_path / "flux.safetensors"))
    with pytest.raises(ValueError, match="presets"):
        lora.resolve_targets("everything")
    with pytest.raises(ValueError, match="match no Linear"):
        lora.inject_lora(transformer, lora.LoraSpec(targets=("to_qq",)))


def test_diffusers_load_lora_weights_reproduces_our_sampler(tiny_edit_dir, tmp_path):
    """The file loads in diffusers' QwenImageEditPipeline.load_lora_weights with the same effect: the
    pipeline's image equals our sampler's with the LoRA, within the parity tolerance."""
    from diffusers import QwenImageEditPipeline
    transformer, spec = _trained(tiny_edit_dir)
    path = lora.save_lora(tmp_path / "l.safetensors", transformer, spec, base_identity="t", steps=1)

    comps = load_components(tiny_edit_dir, DevicePlan.from_mapping({}))
    lora.load_lora_into(comps.transformer, lora.read_lora_file(path), adapter_name="mine")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    settings = sampler.SampleSettings(num_inference_steps=3, true_cfg_scale=3.0, seed=4, width=128, height=128)
    ours = sampler.sample(comps, "invert", [image], settings)[0].numpy()

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_dir)
    pipe.load_lora_weights(str(path))
    ref = pipe(image=image, prompt="invert", negative_prompt=" ", true_cfg_scale=3.0, num_inference_steps=3,
               height=128, width=128, generator=torch.Generator("cpu").manual_seed(4),
               output_type="np").images[0]
    plain = QwenImageEditPipeline.from_pretrained(tiny_edit_dir)(
        image=image, prompt="invert", negative_prompt=" ", true_cfg_scale=3.0, num_inference_steps=3, height=128,
        width=128, generator=torch.Generator("cpu").manual_seed(4), output_type="np").images[0]
    assert np.abs(ref - plain).max() > 1e-3  # the LoRA changes the image...
    assert np.abs(ours - ref).max() <= 1e-4  # ...and both load it the same way
