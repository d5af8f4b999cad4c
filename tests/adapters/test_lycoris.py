"""LoKr, LoHa and DoRA: the files we write make stock ComfyUI patch exactly the weight peft trains; our loader
reads them back with the same outputs and ComfyUI's strength rule; bad combinations are refused by name.

ComfyUI's maths is re-derived here from its source, ComfyUI commit a125cd84b054a57729b5eecab930ca9408719832:
comfy/lora.py `load_lora` (per module base key x: `x.alpha`, `x.dora_scale`, then each weight adapter's `load`),
comfy/weight_adapter/lokr.py, loha.py and lora.py `calculate_weight`, base.py `weight_decompose`; the weight it
patches is a float32 copy (comfy/model_patcher.py `patch_weight_to_device`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import load_file

from qwen_edit_core.adapters import lora
from qwen_edit_core.config import ConfigError, load_config

from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
#: (type, dora, rank): on the tiny model LoKr rank 4 keeps the attention factors full (32 = 4 x 8, 4 >= 8 / 2)
#: and the MLP's w2 low-rank; rank 2 makes every w2 low-rank
KINDS = [("lokr", False, 4), ("lokr", False, 2), ("loha", False, 4), ("lora", True, 4)]
IDS = ["lokr-full", "lokr-lowrank", "loha", "dora"]


@pytest.fixture(scope="module")
def base():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return QwenImageTransformer2DModel(**TINY).eval()


def _trained(base, kind, dora, rank, alpha=3.0, seed=0):
    """A copy of `base` with an adapter of the kind whose every tensor moved randomly (as after training)."""
    model = copy.deepcopy(base)
    spec = lora.LoraSpec(rank=rank, alpha=alpha, targets=lora.resolve_targets("all"), type=kind, dora=dora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lora.inject_lora(model, spec)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in lora.adapter_layers(model).values():
            for p in lora.adapter_parameters(layer, "default"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model, spec


def _output(model):
    g = torch.Generator().manual_seed(0)
    hidden, text = torch.randn(1, 32, 64, generator=g), torch.randn(1, 7, 32, generator=g)
    with torch.no_grad():
        return model(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.5]),
                     img_shapes=[[(1, 4, 4), (1, 4, 4)]], return_dict=False)[0]


def _applied_weights(model) -> dict[str, torch.Tensor]:
    """{module path: the weight the model applies now} for every Linear under a peft layer (the outermost of
    nested ones), run on the identity (minus bias)."""
    out = {}
    for path, base in lora.adaptable_modules(model).items():
        layer = model.get_submodule(path)
        if layer is base:
            continue
        with torch.no_grad():
            y = layer(torch.eye(base.in_features))
        out[path] = (y - (base.bias if base.bias is not None else 0)).T
    assert out, "no adapted layer"
    return out


# -- stock ComfyUI, re-derived -------------------------------------------------------------------------------
def _get(state, key, loaded):
    if key in state:
        loaded.add(key)
        return state[key].float()
    return None


def _comfy_weight(state, x, weight, loaded, strength=1.0):
    """The weight ComfyUI patches for base key x (None: no adapter of these three kinds there)."""
    alpha = _get(state, f"{x}.alpha", loaded)
    alpha = None if alpha is None else alpha.item()
    dora_scale = _get(state, f"{x}.dora_scale", loaded)
    t = {k: _get(state, f"{x}.{k}", loaded) for k in ("lora_up.weight", "lora_down.weight", "lokr_w1", "lokr_w2",
                                                        "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b",
                                                        "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}
    if t["lora_up.weight"] is not None:  # lora.py: alpha / mat2.shape[0], mat2 = down
        up, down = t["lora_up.weight"], t["lora_down.weight"]
        scale, diff = (alpha / down.shape[0] if alpha is not None else 1.0), up @ down
    elif t["hada_w1_a"] is not None:  # loha.py: alpha / w1b.shape[0]
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        diff = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
    elif any(t[k] is not None for k in ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w2_a")):  # lokr.py
        dim, w1, w2 = None, t["lokr_w1"], t["lokr_w2"]
        if w1 is None:
            dim, w1 = t["lokr_w1_b"].shape[0], t["lokr_w1_a"] @ t["lokr_w1_b"]
        if w2 is None:
            dim, w2 = t["lokr_w2_b"].shape[0], t["lokr_w2_a"] @ t["lokr_w2_b"]
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
        diff = torch.kron(w1, w2).reshape(weight.shape)
    else:
        return None
    weight = weight.float().clone()
    if dora_scale is None:
        return weight + strength * scale * diff
    # base.py weight_decompose, dora_scale on the output axis: the norm is the ORIGINAL weight's
    calc = weight + scale * diff
    assert dora_scale.shape[0] == calc.shape[0]
    norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps
    calc = calc * (dora_scale / norm)
    return weight + strength * (calc - weight) if strength != 1.0 else calc


def _comfy_patch(model, state, strength=1.0):
    """{module path: patched weight} for every Linear ComfyUI patches, and the keys it does not load."""
    params = dict(model.named_parameters())
    patched, loaded = {}, set()
    for key, weight in params.items():
        if key.endswith(".weight"):
            new = _comfy_weight(state, "diffusion_model." + key[:-len(".weight")], weight, loaded, strength)
            if new is not None:
                patched[key[:-len(".weight")]] = new
    return patched, sorted(set(state) - loaded)


#: roundings of an adapted weight computed in another order (ComfyUI's patch, peft's layers, our reading of
#: the file): LoHa's two rank-4 products and their Hadamard product (LoKr's product and Kronecker product take
#: fewer), the scale and the sum with the base weight, rounded up
KIND_ROUNDINGS = 16
#: DoRA adds the weight's row norms (sums over up to 128 inputs) and the magnitude's rescale
DORA_ROUNDINGS = 128 + KIND_ROUNDINGS


def _close(got, expected, what: str, *, dora=False, size=None) -> None:
    """`got` is `expected` (an adapted weight, or a weight change with `size` the weight it was taken from)
    up to float32 rounding of the adapter's arithmetic."""
    ops = DORA_ROUNDINGS if dora else KIND_ROUNDINGS
    assert_close_fp32(got, expected, ops=ops, what=what, size=size)


# -- the files ComfyUI reads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,dora,rank", KINDS, ids=IDS)
def test_comfyui_patches_the_weight_peft_applies(base, tmp_path, kind, dora, rank):
    model, spec = _trained(base, kind, dora, rank)
    path = lora.save_lora(tmp_path / "a.safetensors", model, spec, base_identity="tiny", steps=1)
    state = load_file(str(path))
    suffixes = {k.rsplit(".", 1)[-1] if "lora_" not in k else k.split(".")[-2] for k in state}
    expected = {"lokr": {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"} | ({"lokr_w2"} if rank == 4 else set()),
                "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
                "lora": {"lora_down", "lora_up", "alpha", "dora_scale"}}[kind]
    assert suffixes == expected
    if kind == "lokr" and rank == 4:  # full attention factors, low-rank MLP factors
        assert "diffusion_model.transformer_blocks.0.attn.to_q.alpha" not in state
        assert "diffusion_model.transformer_blocks.0.img_mlp.net.2.lokr_w2_a" in state
    patched, not_loaded = _comfy_patch(base, state)
    assert not_loaded == []
    applied = _applied_weights(model)
    assert set(patched) == set(applied) and len(applied) == 12 + 9  # the last block without its text output
    for name, weight in applied.items():
        _close(patched[name], weight, f"{name}: ComfyUI-patched vs peft's", dora=dora)
        if not dora:  # our own reading of the file gives the same delta
            delta = weight - dict(base.named_parameters())[name + ".weight"]  # rounded at the weight's size
            _close(lora.lora_delta(lora.read_lora_file(path), name), delta, f"{name}: our reading", size=weight)


@pytest.mark.parametrize("kind,dora,rank", KINDS, ids=IDS)
def test_read_back_gives_the_trained_outputs_and_comfyui_strength(base, tmp_path, kind, dora, rank):
    model, spec = _trained(base, kind, dora, rank)
    path = lora.save_lora(tmp_path / "a.safetensors", model, spec, base_identity="tiny", steps=1)
    weights = lora.read_lora_file(path)
    assert {layer.kind for layer in weights.layers.values()} == {kind}
    trained, plain = _output(model), _output(base)
    loaded = copy.deepcopy(base)
    lora.load_lora_into(loaded, weights, adapter_name="file")
    # the file's form rebuilt on load (DoRA's magnitude from its scale, factors in ComfyUI's layout)
    assert_close_fp32(_output(loaded), trained, ops=TINY_FORWARD_ROUNDINGS, what="output loaded from the file")
    # continuing training: the file into an injected adapter of the same kind (other rank/alpha for LoRA kinds)
    again = copy.deepcopy(base)
    lora.inject_lora(again, lora.LoraSpec(rank=rank, alpha=1.0, targets=spec.targets, type=kind, dora=dora))
    lora.load_lora_into(again, weights)
    assert_close_fp32(_output(again), trained, ops=TINY_FORWARD_ROUNDINGS, what="output loaded into another rank")
    # strength 0.5 equals ComfyUI's patch at 0.5, loaded directly or through a sampling stack
    half = copy.deepcopy(base)
    lora.load_lora_into(half, weights, strength=0.5)
    patched, _ = _comfy_patch(base, load_file(str(path)), strength=0.5)
    for name, weight in _applied_weights(half).items():
        _close(weight, patched[name], f"{name} at strength 0.5 vs ComfyUI's", dora=dora)
    stacked = copy.deepcopy(base)
    lora.apply_loras(stacked, [(weights, 0.5)])
    assert torch.equal(_output(stacked), _output(half))
    lora.apply_loras(stacked, [(weights, 0.0)])
    assert torch.equal(_output(stacked), plain)


def test_kinds_stack_with_a_plain_lora(base, tmp_path):
    """A LoKr file and a plain LoRA file active together: the weight changes add."""
    lokr_model, lokr_spec = _trained(base, "lokr", False, 2)
    lora_model, lora_spec = _trained(base, "lora", False, 4, seed=1)
    wa = lora.read_lora_file(lora.save_lora(tmp_path / "k.safetensors", lokr_model, lokr_spec, base_identity="t",
                                            steps=1))
    wb = lora.read_lora_file(lora.save_lora(tmp_path / "l.safetensors", lora_model, lora_spec, base_identity="t",
                                            steps=1))
    both = copy.deepcopy(base)
    lora.apply_loras(both, [(wa, 0.5), (wb, 1.0)])
    for name, weight in _applied_weights(both).items():
        expected = base.get_submodule(name).weight + 0.5 * lora.lora_delta(wa, name) + lora.lora_delta(wb, name)
        _close(weight, expected, f"{name} with LoKr and LoRA stacked")


# -- refused combinations ------------------------------------------------------------------------------------
def test_bad_combinations_are_refused_by_name(base, tmp_path):
    with pytest.raises(ValueError, match="model.lora.dora: true works with model.lora.type lora only, not 'lokr'"):
        lora.LoraSpec(type="lokr", dora=True)
    with pytest.raises(ValueError, match="model.lora.type 'lokra' is not accepted; accepted: lora, lokr, loha"):
        lora.LoraSpec(type="lokra")
    with pytest.raises(ValueError, match="model.lora.dropout 0.1 applies to type lora"):
        lora.LoraSpec(type="loha", dropout=0.1)
    with pytest.raises(ConfigError, match="model.lora.dora: true works with model.lora.type lora only, not 'loha'"):
        load_config(overrides={"model": {"lora": {"type": "loha", "dora": True}}})
    with pytest.raises(ConfigError, match="model.lora.type"):
        load_config(overrides={"model": {"lora": {"type": "lokra"}}})
    assert load_config(overrides={"model": {"lora": {"type": "lokr"}}}).model.lora.type == "lokr"
    # a LoHa file into a LoKr adapter, a DoRA file into a plain LoRA adapter
    loha_model, loha_spec = _trained(base, "loha", False, 4)
    loha = lora.read_lora_file(lora.save_lora(tmp_path / "h.safetensors", loha_model, loha_spec,
                                              base_identity="t", steps=1))
    target = copy.deepcopy(base)
    lora.inject_lora(target, lora.LoraSpec(rank=4, targets=loha_spec.targets, type="lokr"))
    with pytest.raises(ValueError, match="file loha, adapter lokr.*match model.lora type/dora"):
        lora.load_lora_into(target, loha)
    dora_model, dora_spec = _trained(base, "lora", True, 4)
    dora = lora.read_lora_file(lora.save_lora(tmp_path / "d.safetensors", dora_model, dora_spec,
                                              base_identity="t", steps=1))
    target = copy.deepcopy(base)
    lora.inject_lora(target, lora.LoraSpec(rank=4, targets=dora_spec.targets))
    with pytest.raises(ValueError, match="DoRA in one of the file and the adapter only"):
        lora.load_lora_into(target, dora)


def test_fp8_bases_refuse_lokr_loha_and_dora(base):
    from qwen_edit_core import speed
    for kind, dora in (("lokr", False), ("loha", False), ("lora", True)):
        model = copy.deepcopy(base).requires_grad_(False)
        speed.quantize_fp8(model)
        with pytest.raises(ValueError, match="on an fp8 base layer .* model.transformer_fp8: upcast"):
            lora.inject_lora(model, lora.LoraSpec(rank=4, type=kind, dora=dora))


def test_files_with_conv_factors_or_mixed_kinds_are_refused(tmp_path):
    from safetensors.torch import save_file
    q = "diffusion_model.transformer_blocks.0.attn.to_q"
    path = tmp_path / "t2.safetensors"
    save_file({f"{q}.lokr_w1": torch.ones(4, 4), f"{q}.lokr_w2_a": torch.ones(8, 2), f"{q}.lokr_w2_b": torch.ones(2, 8),
               f"{q}.lokr_t2": torch.ones(2, 2, 1, 1)}, str(path))
    with pytest.raises(ValueError, match="lokr_t2' is a convolution"):
        lora.read_lora_file(path)
    save_file({f"{q}.lokr_w1": torch.ones(4, 4), f"{q}.lora_down.weight": torch.ones(2, 32)}, str(path))
    with pytest.raises(ValueError, match="mixes LoKr/LoHa keys"):
        lora.read_lora_file(path)


def test_file_stacks_switch_strengths_and_train_beside_companions(base, tmp_path):
    """`activate` (sampling from files): a DoRA file at 0.5 then 1 equals loading it at each strength; a LoKr
    adapter in training beside a plain LoRA companion: only the LoKr tensors train, the weight changes add."""
    dora_model, dora_spec = _trained(base, "lora", True, 4)
    dora_path = lora.save_lora(tmp_path / "d.safetensors", dora_model, dora_spec, base_identity="t", steps=1)
    model = copy.deepcopy(base)
    for strength in (0.5, 1.0):
        lora.activate(model, [(str(dora_path), strength)])
        direct = copy.deepcopy(base)
        lora.load_lora_into(direct, lora.read_lora_file(dora_path), strength=strength)
        assert torch.equal(_output(model), _output(direct)), strength
    companion_model, companion_spec = _trained(base, "lora", False, 4, seed=2)
    companion = lora.save_lora(tmp_path / "c.safetensors", companion_model, companion_spec, base_identity="t",
                               steps=1)
    training, spec = _trained(base, "lokr", False, 2)
    lora.activate_with_trained(training, [(str(companion), 0.5)])
    trainable = {n for n, p in training.named_parameters() if p.requires_grad}
    assert trainable and all(".lokr_" in n and n.endswith(".default") for n in trainable)
    lokr = lora.read_lora_file(lora.save_lora(tmp_path / "k.safetensors", training, spec, base_identity="t",
                                              steps=1))
    plain = lora.read_lora_file(companion)
    for name, weight in _applied_weights(training).items():
        expected = base.get_submodule(name).weight + lora.lora_delta(lokr, name) + 0.5 * lora.lora_delta(plain, name)
        _close(weight, expected, f"{name} trained LoKr beside a companion")
