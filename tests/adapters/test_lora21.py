"""Qwen-Image-2.1 LoRA files: the file we write loads in stock ComfyUI's 2.1 model (its MLP gate/up fused) with the
effect peft trained, by ComfyUI's key map and patch rule re-derived from its source (comfy/lora.py, Comfy-Org/ComfyUI
commit 17358c8f73b581a0d22facc3c385822f09b8bfb1: `model_lora_keys_unet` and `load_lora`; the fused layout from
comfy/ldm/qwen_image21/model.py), and in diffusers' `QwenImage21Pipeline.load_lora_weights`; files in ComfyUI's
fused layout and in peft/diffusers' layout load into ours with their effect."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import QwenImage21Transformer2DModel
from peft import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from qwen_edit_core.adapters import lora
from qwen_edit_core.families import QWEN_IMAGE_21
from qwen_edit_core.families.qwen_image_21.tiny import transformer_config

from tolerances import assert_close_fp32

#: roundings of a weight with a LoRA merged in another order (ComfyUI: W += scale * up @ down on the fused
#: weight; peft: W + (B @ A) * scale): a rank-4 product summed, one scale, one addition, rounded up
MERGE_ROUNDINGS = 8


@pytest.fixture(scope="module")
def base():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return QwenImage21Transformer2DModel(**transformer_config("tiny")).eval()


def _trained(model, kind: dict | None = None, rank=4, alpha=8.0):
    """A copy of `model` with an adapter on the "all" preset whose factors are random (as after training)."""
    model = copy.deepcopy(model)
    spec = lora.LoraSpec(rank=rank, alpha=alpha, targets=lora.resolve_targets("all", QWEN_IMAGE_21.lora_targets),
                         **(kind or {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lora.inject_lora(model, spec)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad and "magnitude" not in name:
                    p.normal_(0, 0.05)
    return model, spec


def _merged(model) -> dict[str, torch.Tensor]:
    """{module path: the weight peft runs (base + adapter)} of every adapted module."""
    model = copy.deepcopy(model)
    lora.merge_lora(model)
    return {path: layer.get_base_layer().weight.detach().clone() for path, layer in lora.adapter_layers(model).items()}


def _comfy_state(model) -> dict[str, torch.Tensor]:
    """The state dict ComfyUI's 2.1 model holds for these weights: `diffusion_model.` + diffusers' names, each
    block's `img_mlp.gate_layer` and `img_mlp.proj` fused into `img_mlp.gate_up` = [gate_layer; proj]."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    for key, value in state.items():
        if key.endswith("img_mlp.gate_layer.weight"):
            out["diffusion_model." + key.replace("gate_layer", "gate_up")] = torch.cat(
                [value, state[key.replace("gate_layer", "proj")]])
        elif not key.endswith("img_mlp.proj.weight"):
            out["diffusion_model." + key] = value
    return out


def _comfy_key_map(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, int, int] | None]]:
    """ComfyUI's LoRA key -> (state-dict key, offset) for a QwenImage model, re-derived: every `diffusion_model.P`
    weight answers to `lora_unet_P_` and `diffusion_model.P` (generic), and to `P`, `transformer.P` and `lycoris_P_`
    (QwenImage); a fused `img_mlp.gate_up` answers to `...gate_layer` (rows [0, half)) and `...proj` (rows
    [half, 2 half)) under the three QwenImage names only."""
    key_map = {}
    for k, v in state.items():
        if not k.endswith(".weight"):
            continue
        path = k[len("diffusion_model."):-len(".weight")]
        key_map["lora_unet_" + path.replace(".", "_")] = (k, None)
        key_map["diffusion_model." + path] = (k, None)
        targets = [(path, None)]
        if path.endswith(".img_mlp.gate_up"):
            half = v.shape[0] // 2
            targets = [(path.replace(".gate_up", ".gate_layer"), (0, 0, half)),
                       (path.replace(".gate_up", ".proj"), (0, half, half))]
        for name, offset in targets:
            for key in (name, "transformer." + name, "lycoris_" + name.replace(".", "_")):
                key_map[key] = (k, offset)
    return key_map


def _comfy_patch(file: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Patch `state` with a LoRA file (lora_down/lora_up/alpha keys) as ComfyUI's `load_lora` + `calculate_weight`
    do: W.narrow(offset) += alpha / rank * up @ down (scale 1 without alpha); every key must be loaded."""
    key_map, patched, loaded = _comfy_key_map(state), {k: v.clone() for k, v in state.items()}, set()
    for x, (target, offset) in key_map.items():
        down, up = file.get(f"{x}.lora_down.weight"), file.get(f"{x}.lora_up.weight")
        if down is None or up is None:
            continue
        alpha = file.get(f"{x}.alpha")
        loaded |= {f"{x}.lora_down.weight", f"{x}.lora_up.weight"} | ({f"{x}.alpha"} if alpha is not None else set())
        scale = alpha.item() / down.shape[0] if alpha is not None else 1.0
        weight = patched[target] if offset is None else patched[target].narrow(*offset)
        weight += scale * up.float() @ down.float()
    assert sorted(set(file) - loaded) == [], "lora key not loaded"
    return patched


def test_every_trained_tensor_reaches_comfyuis_fused_21_model_with_peft_effect(base, tmp_path):
    model, spec = _trained(base)
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="tiny", steps=1)
    file = load_file(path)
    assert all(k.startswith("transformer_blocks.") for k in file)  # bare module paths
    assert any(".img_mlp.gate_layer." in k for k in file) and any(".img_mlp.proj." in k for k in file)
    patched = _comfy_patch(file, _comfy_state(base))
    expected = _comfy_state(_merged_model(model))
    changed = [k for k in expected if not torch.equal(patched[k], _comfy_state(base)[k])]
    assert len(changed) == 2 * 6  # to_q, to_k, to_v, to_out.0, gate_up, out in each of the 2 blocks
    for k in expected:
        assert_close_fp32(patched[k], expected[k], ops=MERGE_ROUNDINGS, what=f"{k} ComfyUI-patched vs peft-merged")


def _merged_model(model):
    model = copy.deepcopy(model)
    lora.merge_lora(model)
    return _unwrapped(model)


def _unwrapped(model):
    """A plain transformer holding `model`'s current (merged) weights."""
    plain = QwenImage21Transformer2DModel(**transformer_config("tiny"))
    state = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items()
             if "lora_" not in k and "lokr_" not in k and "hada_" not in k}
    plain.load_state_dict(state)
    return plain


def test_a_comfyui_fused_layout_file_loads_into_ours_with_comfyuis_effect(base, tmp_path):
    """A LoRA on ComfyUI's names (`diffusion_model.` attention, the fused `gate_up`, as ComfyUI-side trainers write
    them) loads onto our split modules: each of gate_layer / proj gets its rows of the fused delta."""
    torch.manual_seed(4)
    inner = base.config.num_attention_heads * base.config.attention_head_dim
    hidden = inner * base.config.mlp_ratio
    file = {}
    for b in range(base.config.num_layers):
        for name, out_f, in_f in (("attn.to_q", inner, inner), ("img_mlp.gate_up", 2 * hidden, inner),
                                  ("img_mlp.out", inner, hidden)):
            key = f"diffusion_model.transformer_blocks.{b}.{name}"
            file[f"{key}.lora_down.weight"] = torch.randn(3, in_f) * 0.1
            file[f"{key}.lora_up.weight"] = torch.randn(out_f, 3) * 0.1
            file[f"{key}.alpha"] = torch.tensor(6.0)
    save_file(file, tmp_path / "fused.safetensors")
    model = copy.deepcopy(base)
    lora.load_lora_file(model, tmp_path / "fused.safetensors")
    ours = _comfy_state(_merged_model(model))
    comfy = _comfy_patch(file, _comfy_state(base))
    for k in comfy:
        assert_close_fp32(ours[k], comfy[k], ops=MERGE_ROUNDINGS, what=f"{k} ours merged vs ComfyUI-patched")


def test_a_peft_diffusers_layout_file_loads_into_ours_with_the_same_effect(base, tmp_path):
    """`transformer.P.lora_A/lora_B.weight` as diffusers' `save_lora_weights` writes peft's state dict (alpha = rank,
    scale 1) loads into ours with peft's effect."""
    model, _ = _trained(base, rank=4, alpha=4.0)
    state = {f"transformer.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    assert any(".lora_A.weight" in k for k in state)
    save_file(state, tmp_path / "peft.safetensors")
    other = copy.deepcopy(base)
    lora.load_lora_file(other, tmp_path / "peft.safetensors")
    expected, got = _merged(model), _merged(other)
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k  # the same factors and scale (alpha = rank): the same merge


def test_diffusers_qwenimage21_pipeline_loads_our_file_with_the_same_effect(tiny_21_dir, tmp_path):
    from diffusers import QwenImage21Pipeline
    assert hasattr(QwenImage21Pipeline, "load_lora_weights")  # QwenImageLoraLoaderMixin
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_dir)
    model, spec = _trained(pipe.transformer)
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="tiny", steps=1)
    pipe.load_lora_weights(str(tmp_path), weight_name=path.name, adapter_name="ours")
    pipe.fuse_lora(adapter_names=["ours"])
    expected = _merged(model)
    fused = dict(pipe.transformer.named_modules())
    for k, weight in expected.items():
        module = fused[k]
        module = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        assert_close_fp32(module.weight, weight, ops=MERGE_ROUNDINGS, what=f"{k} fused by diffusers vs peft-merged")


@pytest.mark.parametrize("kind", [{"dora": True}, {"type": "lokr"}])
def test_dora_and_lokr_files_reach_comfyuis_fused_model(base, tmp_path, kind):
    """DoRA and LoKr layers on gate_layer / proj are written under names ComfyUI maps onto the fused weight's
    halves; their effect per half (our reading of ComfyUI's rule for the kind: lora_files.effective_delta) is
    what peft runs."""
    model, spec = _trained(base, kind)
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="tiny", steps=1)
    file = load_file(path)
    key_map = _comfy_key_map(_comfy_state(base))
    weights = lora.read_lora_file(path)
    merged = _merged(model)
    base_modules = lora.adaptable_modules(base)
    for module, layer in weights.layers.items():
        assert module in key_map and any(k.startswith(f"{module}.") for k in file)
        base_weight = base_modules[module].weight.detach()
        delta = lora.effective_delta(layer, base_weight)
        # DoRA: the weight's row norms (sums over up to 96 inputs) and a rescale; LoKr: a Kronecker product of
        # rank-4 factors; either against peft's merge, in another order
        assert_close_fp32(base_weight + delta, merged[module], ops=96 + MERGE_ROUNDINGS, what=f"{module} effect")


def test_the_fused_layout_loads_in_comfyui_with_every_key_and_reads_back_with_the_same_effect(base, tmp_path):
    """`train.lora_format: fused` writes ComfyUI's own layout (`diffusion_model.` keys, one `img_mlp.gate_up` LoRA
    per block): every key reaches ComfyUI's fused model (its generic `diffusion_model.P` mapping) with peft's
    effect, and the file reads back into ours with the effect of the split file."""
    model, spec = _trained(base)
    fused = lora.save_lora(tmp_path / "fused.safetensors", model, spec, base_identity="tiny", steps=1, layout="fused")
    split = lora.save_lora(tmp_path / "split.safetensors", model, spec, base_identity="tiny", steps=1)
    file = load_file(fused)
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in file)
    assert not any(".gate_layer." in k or ".img_mlp.proj." in k for k in file)
    assert file["diffusion_model.transformer_blocks.0.img_mlp.gate_up.lora_down.weight"].shape[0] == 2 * spec.rank
    patched = _comfy_patch(file, _comfy_state(base))  # asserts that no key is left unloaded
    expected = _comfy_state(_merged_model(model))
    for k in expected:
        assert_close_fp32(patched[k], expected[k], ops=MERGE_ROUNDINGS, what=f"{k} ComfyUI-patched fused file")
    from_fused, from_split = copy.deepcopy(base), copy.deepcopy(base)
    lora.load_lora_file(from_fused, fused)
    lora.load_lora_file(from_split, split)
    a, b = _merged(from_fused), _merged(from_split)
    assert a.keys() == b.keys() == _merged(model).keys()
    for k in a:
        assert_close_fp32(a[k], b[k], ops=MERGE_ROUNDINGS, what=f"{k} read from the fused file vs the split one")


def test_fusing_halves_of_different_scales_or_one_half_keeps_each_halfs_delta():
    """Unequal alphas are folded into the ups; a block with one half trained gets a zero block for the other."""
    torch.manual_seed(5)
    down_g, up_g, down_p, up_p = torch.randn(4, 6), torch.randn(10, 4), torch.randn(2, 6), torch.randn(10, 2)
    split = {"b.img_mlp.gate_layer.lora_down.weight": down_g, "b.img_mlp.gate_layer.lora_up.weight": up_g,
             "b.img_mlp.gate_layer.alpha": torch.tensor(8.0), "b.img_mlp.proj.lora_down.weight": down_p,
             "b.img_mlp.proj.lora_up.weight": up_p, "b.img_mlp.proj.alpha": torch.tensor(1.0),
             "b.attn.to_q.lora_down.weight": down_p}
    fused = lora.fuse_mlp_tensors(split)
    delta = fused["diffusion_model.b.img_mlp.gate_up.alpha"] / 6 * (
        fused["diffusion_model.b.img_mlp.gate_up.lora_up.weight"] @ fused["diffusion_model.b.img_mlp.gate_up.lora_down.weight"])
    assert_close_fp32(delta, torch.cat([2.0 * up_g @ down_g, 0.5 * up_p @ down_p]), ops=8, what="fused delta")
    assert torch.equal(fused["diffusion_model.b.attn.to_q.lora_down.weight"], down_p)
    only = lora.fuse_mlp_tensors({k: v for k, v in split.items() if ".proj." in k})
    up = only["diffusion_model.b.img_mlp.gate_up.lora_up.weight"]
    assert up.shape == (20, 2) and torch.equal(up[:10], torch.zeros(10, 2)) and torch.equal(up[10:], up_p)


def test_the_fused_layout_is_refused_for_a_model_without_the_fused_mlp_and_for_lokr(base, tmp_path):
    with pytest.raises(ValueError, match="train.lora_format 'fused': this model has no fused MLP layout"):
        lora.check_fusable(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model, spec = _trained(base, {"type": "lokr"})
    with pytest.raises(ValueError, match="LoKr/LoHa layers cannot be written in the fused layout"):
        lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="tiny", steps=1, layout="fused")


def test_a_dora_lora_in_the_fused_layout_reads_back_with_the_split_files_effect(base, tmp_path):
    model, spec = _trained(base, {"dora": True})
    fused = lora.save_lora(tmp_path / "f.safetensors", model, spec, base_identity="tiny", steps=1, layout="fused")
    split = lora.save_lora(tmp_path / "s.safetensors", model, spec, base_identity="tiny", steps=1)
    assert load_file(fused)["diffusion_model.transformer_blocks.0.img_mlp.gate_up.dora_scale"].shape[0] == \
        2 * base.transformer_blocks[0].img_mlp.gate_layer.weight.shape[0]
    from_fused, from_split = copy.deepcopy(base), copy.deepcopy(base)
    lora.load_lora_file(from_fused, fused)
    lora.load_lora_file(from_split, split)
    a, b = _merged(from_fused), _merged(from_split)
    for k in a:
        assert_close_fp32(a[k], b[k], ops=MERGE_ROUNDINGS, what=f"{k} DoRA from the fused file vs the split one")


def test_the_lora_format_flag_sets_the_config_key():
    from qwen_edit_core.cli import build_parser, train_overrides
    args = build_parser().parse_args(["train", "c.yaml", "--lora-format", "fused"])
    assert train_overrides(args) == {"train": {"lora_format": "fused"}}


def test_a_fused_layout_on_a_model_without_the_fused_mlp_is_refused_before_the_first_step(tiny_edit_dir, pairs_dir,
                                                                                          tmp_path):
    from conftest import train_config

    from qwen_edit_core import QwenImageEditTrainer
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={"lora_format": "fused"})
    with pytest.raises(ValueError, match="train.lora_format 'fused': this model has no fused MLP layout"):
        QwenImageEditTrainer(config).fit()
    assert not (tmp_path / "o" / "checkpoints").exists() and not list((tmp_path / "o").glob("*.safetensors"))
