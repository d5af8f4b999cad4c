"""LoRA adapters and files: injection, keys stock ComfyUI loads with the same effect, round trips, every
accepted layout, bad files, several LoRAs with strengths, merge/unmerge, diffusers' loader.

The tiny transformer is built here (2 blocks, 2 heads x 16); only the pipeline test uses the tiny_edit_dir
fixture.
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageTransformer2DModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qwen_edit_core.adapters import lora

from tolerances import TINY_FORWARD_ROUNDINGS, TINY_SAMPLER_ROUNDINGS, assert_close_fp32

#: roundings of a rank-4 LoRA delta: 4 products summed, the alpha / rank scale applied to the product or
#: folded into a factor (other orders in ComfyUI, peft and the layouts' conversions), rounded up
LORA_DELTA_ROUNDINGS = 8

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


@pytest.fixture(scope="module")
def base():
    """The base transformer every test copies (fixed seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return QwenImageTransformer2DModel(**TINY).eval()


def _fresh(model):
    return copy.deepcopy(model)


def _trained(model, targets="all", rank=4, alpha=8.0, seed=0, adapter_name="default"):
    """A copy of `model` with a LoRA whose A and B are random (as after training)."""
    model = _fresh(model)
    spec = lora.LoraSpec(rank=rank, alpha=alpha, targets=lora.resolve_targets(targets))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lora.inject_lora(model, spec, adapter_name=adapter_name)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in lora.adapter_layers(model, adapter_name).values():
            layer.lora_B[adapter_name].weight.copy_(0.05 * torch.randn(layer.lora_B[adapter_name].weight.shape,
                                                                       generator=g))
    return model, spec


def _output(model, seed=0):
    """One transformer forward on fixed inputs: 16 target + 16 control tokens, 7 text tokens."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 32, cfg.in_channels, generator=g)
    text = torch.randn(1, 7, cfg.joint_attention_dim, generator=g)
    with torch.no_grad():
        return model(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.5]),
                     img_shapes=[[(1, 4, 4), (1, 4, 4)]], return_dict=False)[0]


def _max_diff(a, b):
    return (a - b).abs().max().item()


def _same_output(got, expected, what: str) -> None:
    """`got` computes `expected`'s forward up to float32 rounding: the same weight changes applied in another
    order (merged into the weight, or beside it as a rank-4 product scaled and added) round differently."""
    assert_close_fp32(_output(got), _output(expected), ops=TINY_FORWARD_ROUNDINGS, what=f"output of {what}")


def _deltas(weights):
    return {name: lora.lora_delta(weights, name) for name in weights.layers}


# -- stock ComfyUI's loader, as in ComfyUI 0.3.64 (commit a125cd84) --------------------------------------------
def _comfy_key_map(model):
    """comfy/lora.py `model_lora_keys_unet` for a QwenImage model: LoRA base key -> model weight key.
    Generic part: `lora_unet_P_` and `diffusion_model.P` for every `.weight`; QwenImage part: `P`,
    `transformer.P`, `lycoris_P_` (dots to underscores in the last). `unet_to_diffusers` gives nothing here."""
    key_map = {}
    for k in model.state_dict():
        k = "diffusion_model." + k
        if not k.endswith(".weight"):
            key_map[k] = k
            continue
        p = k[len("diffusion_model."):-len(".weight")]
        key_map["lora_unet_" + p.replace(".", "_")] = k
        key_map["diffusion_model." + p] = k
        key_map[p] = k
        key_map["transformer." + p] = k
        key_map["lycoris_" + p.replace(".", "_")] = k
    return key_map


# comfy/weight_adapter/lora.py LoRAAdapter.load: (up, down) suffix pairs it tries, in order.
_COMFY_PAIRS = ((".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
                (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
                (".lora_B", ".lora_A"), (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
                (".lora_B.default.weight", ".lora_A.default.weight"))


def _comfy_load(state, key_map):
    """comfy/lora.py `load_lora`: ({model weight key: (up, down, alpha)}, keys it logs as "lora key not
    loaded"). `.alpha` is read when present (else None -> scale 1); metadata is never read."""
    patches, loaded = {}, set()
    for x, target in key_map.items():
        alpha = None
        if x + ".alpha" in state:
            alpha = state[x + ".alpha"].item()
            loaded.add(x + ".alpha")
        for up_s, down_s in _COMFY_PAIRS:
            if x + up_s in state:
                patches[target] = (state[x + up_s], state[x + down_s], alpha)
                loaded |= {x + up_s, x + down_s}
                break
    return patches, sorted(set(state) - loaded)


def _comfy_delta(patch, strength=1.0):
    """LoRAAdapter.calculate_weight: strength * (alpha / down.shape[0] or 1) * up @ down, in float32."""
    up, down, alpha = patch
    scale = alpha / down.shape[0] if alpha is not None else 1.0
    return strength * scale * (up.float() @ down.float())


def _comfy_apply(model, state, strength=1.0):
    """A copy of the plain `model` with `state` applied as ComfyUI would; returns it and the unloaded keys."""
    patched = _fresh(model)
    patches, not_loaded = _comfy_load(state, _comfy_key_map(patched))
    params = dict(patched.named_parameters())
    with torch.no_grad():
        for key, patch in patches.items():
            params[key.removeprefix("diffusion_model.")] += _comfy_delta(patch, strength)
    return patched, not_loaded, patches


# -- injection -----------------------------------------------------------------------------------------------
def test_presets_and_targets_match_full_paths_exactly(base):
    assert lora.resolve_targets("attn") == lora.TARGET_PRESETS["attn"] == lora.LoraSpec().targets
    assert lora.resolve_targets(["to_q", "img_mlp.net.2"]) == ("to_q", "img_mlp.net.2")
    assert lora.resolve_targets("to_q, to_k") == ("to_q", "to_k")
    assert lora.resolve_targets(["attn-img", "to_q", "img_mlp.net.2"])[-1] == "img_mlp.net.2"
    # per block; the last block's to_add_out and txt_mlp (2 layers) reach no loss and are left out
    expected = {"attn": (8, 7), "attn-img": (4, 4), "all": (12, 9)}
    for preset, per_block in expected.items():
        model, _ = _trained(base, targets=preset)
        paths = set(lora.adapter_layers(model))
        assert len(paths) == sum(per_block)
        assert all(p.startswith("transformer_blocks.") for p in paths)
    model, _ = _trained(base, targets=("to_out.0",))
    assert set(lora.adapter_layers(model)) == {f"transformer_blocks.{i}.attn.to_out.0" for i in range(2)}
    model, _ = _trained(base, targets="attn-img")
    assert not any("add_" in p or "to_add_out" in p for p in lora.adapter_layers(model))


def test_inject_trains_only_the_lora_and_starts_as_the_base(base):
    model = _fresh(base)
    torch.manual_seed(0)
    lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["all"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(trainable) == 2 * (12 + 9)
    assert _max_diff(_output(model), _output(base)) == 0.0  # B starts at zero
    gaussian = _fresh(base)
    lora.inject_lora(gaussian, lora.LoraSpec(rank=4, targets=("to_q",), init="gaussian"))
    assert len(lora.adapter_layers(gaussian)) == 2


def test_the_modules_left_out_are_those_autograd_gives_no_gradient(base):
    """`unreached_modules` (the family's `unreached_in_last_block` in the last block) is exactly the set of Linear
    modules whose weight gets no gradient from the transformer's output, derived here by autograd."""
    model = _fresh(base)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for m in linears.values():
        m.weight.requires_grad_(True)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    out = model(hidden_states=torch.randn(1, 32, cfg.in_channels, generator=g),
                encoder_hidden_states=torch.randn(1, 7, cfg.joint_attention_dim, generator=g),
                timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4), (1, 4, 4)]], return_dict=False)[0]
    out.square().sum().backward()
    unreached = {n for n, m in linears.items() if m.weight.grad is None}
    assert unreached == lora.unreached_modules(model) == {
        "transformer_blocks.1.attn.to_add_out", "transformer_blocks.1.txt_mlp.net.0.proj",
        "transformer_blocks.1.txt_mlp.net.2"}
    with pytest.raises(ValueError, match="reaches no loss"):
        lora.inject_lora(_fresh(base), lora.LoraSpec(targets=("transformer_blocks.1.attn.to_add_out",)))


def test_an_older_file_with_the_discarded_layers_continues_training(base, tmp_path, monkeypatch):
    """model.lora.init_from with a file trained before those layers were left out: they are dropped (their delta
    changes no output), the rest load, and the output is the file's."""
    with monkeypatch.context() as patch:
        patch.setattr(lora, "unreached_modules", lambda model: frozenset())  # the older injection
        model, spec = _trained(base, targets="all")
    assert "transformer_blocks.1.attn.to_add_out" in lora.adapter_layers(model)
    weights = lora.read_lora_file(lora.save_lora(tmp_path / "old.safetensors", model, spec, base_identity="t",
                                                 steps=3))
    target = _fresh(base)
    lora.inject_lora(target, lora.LoraSpec(rank=4, alpha=8.0, targets=lora.TARGET_PRESETS["all"]))
    lora.load_lora_into(target, weights, adapter_name="default")
    assert torch.equal(_output(target), _output(model))


def test_inject_refuses_inference_tensors_and_bad_specs(base):
    with torch.inference_mode():
        frozen = QwenImageTransformer2DModel(**TINY)
    with pytest.raises(RuntimeError, match="inference tensor"):
        lora.inject_lora(frozen, lora.LoraSpec(rank=2))
    with pytest.raises(ValueError, match=r"\['to_qq'\].*presets"):
        lora.inject_lora(_fresh(base), lora.LoraSpec(targets=("to_q", "to_qq")))
    with pytest.raises(ValueError, match="presets: attn, attn-img, all"):
        lora.resolve_targets("everything")
    with pytest.raises(ValueError, match="rank"):
        lora.LoraSpec(rank=0)
    with pytest.raises(ValueError, match="default, gaussian"):
        lora.LoraSpec(init="pissa")


# -- the file ComfyUI loads ---------------------------------------------------------------------------------
def test_saved_keys_load_fully_in_stock_comfyui_with_the_same_effect(base, tmp_path):
    model, spec = _trained(base)
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="tiny", steps=7)
    state = load_file(path)
    layers = lora.adapter_layers(model)
    assert set(state) == {f"diffusion_model.{p}.{s}" for p in layers
                          for s in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert all(state[k].dtype == torch.float32 and state[k].dim() == 0 for k in state if k.endswith(".alpha"))
    assert all(state[k].item() == spec.alpha for k in state if k.endswith(".alpha"))

    patched, not_loaded, patches = _comfy_apply(base, state)
    assert not_loaded == []  # ComfyUI would log "lora key not loaded" for each of these
    assert len(patches) == len(layers) == 12 + 9  # the last block without its text output
    for p, layer in layers.items():
        comfy = _comfy_delta(patches[f"diffusion_model.{p}.weight"])
        assert_close_fp32(comfy, layer.get_delta_weight("default"), ops=LORA_DELTA_ROUNDINGS, what=f"{p} delta")
    _same_output(patched, model, "patched vs model")
    assert _max_diff(_output(model), _output(base)) > 1e-3  # the LoRA does something


def test_comfyui_emulation_refuses_what_comfyui_refuses(base, tmp_path):
    """ComfyUI's comfy/lora.py does not map `model.diffusion_model.P` (docs/MODEL.md): our emulation must agree."""
    model, spec = _trained(base, targets=("to_q",))
    state = {"model." + k: v for k, v in lora.lora_state_dict_comfy(model).items()}
    _, not_loaded, patches = _comfy_apply(base, state)
    assert patches == {} and len(not_loaded) == len(state)


def test_half_precision_file_still_loads_in_comfyui(base, tmp_path):
    model, spec = _trained(base, targets="attn")
    path = lora.save_lora(tmp_path / "bf16.safetensors", model, spec, base_identity="t", steps=1, dtype=torch.bfloat16)
    state = load_file(path)
    assert {v.dtype for k, v in state.items() if not k.endswith(".alpha")} == {torch.bfloat16}
    assert {v.dtype for k, v in state.items() if k.endswith(".alpha")} == {torch.float32}
    patched, not_loaded, _ = _comfy_apply(base, state)
    assert not_loaded == [] and _max_diff(_output(patched), _output(model)) < 1e-2
    with pytest.raises(ValueError, match="dtype"):
        lora.save_lora(tmp_path / "i.safetensors", model, spec, base_identity="t", steps=1, dtype=torch.int8)


def test_metadata(base, tmp_path):
    model, spec = _trained(base, targets="attn")
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="tiny-id", steps=12,
                          extra_metadata={"dataset": "pairs", "lr": 1e-4, "rank": "overridden?"})
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["format"] == "comfyui-lora" and meta["rank"] == "4" and meta["alpha"] == "8.0"
    assert meta["base_identity"] == "tiny-id" and meta["steps"] == "12"
    assert meta["dataset"] == "pairs" and meta["lr"] == "0.0001"
    import json
    assert tuple(json.loads(meta["targets"])) == lora.TARGET_PRESETS["attn"]
    assert lora.read_lora_file(path).metadata == meta
    with pytest.raises(ValueError, match="no LoRA adapter 'other'"):
        lora.save_lora(tmp_path / "x.safetensors", model, spec, base_identity="t", steps=1, adapter_name="other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.safetensors"]


def test_save_is_atomic(base, tmp_path, monkeypatch):
    """A failing write leaves no partial file and keeps the previous file intact."""
    import safetensors.torch
    model, spec = _trained(base, targets="attn")
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="t", steps=1)
    before = path.read_bytes()

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        lora.save_lora(path, model, spec, base_identity="t", steps=2)
    with pytest.raises(OSError, match="disk full"):
        lora.save_lora(tmp_path / "new.safetensors", model, spec, base_identity="t", steps=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.safetensors"]
    assert path.read_bytes() == before


# -- round trips ----------------------------------------------------------------------------------------------
def test_round_trip_into_a_fresh_model(base, tmp_path):
    model, spec = _trained(base)
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="t", steps=3)
    fresh = _fresh(base)
    lora.load_lora_into(fresh, lora.read_lora_file(path), adapter_name="default")
    assert torch.equal(_output(fresh), _output(model))
    trainable = [n for n, p in fresh.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * (12 + 9) and all(".lora_" in n for n in trainable)  # training can continue
    again = lora.save_lora(tmp_path / "again.safetensors", fresh, spec, base_identity="t", steps=3)
    first, second = load_file(path), load_file(again)
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)


def test_continue_training_in_an_existing_adapter(base, tmp_path):
    """The trainer injects its adapter first, then loads a file into it (model.lora.init_from): the file's
    effect is reproduced and the adapter keeps its own alpha."""
    model, spec = _trained(base, targets="attn", alpha=8.0)
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="t", steps=3)
    weights = lora.read_lora_file(path)

    target = _fresh(base)
    lora.inject_lora(target, lora.LoraSpec(rank=4, alpha=2.0, targets=lora.TARGET_PRESETS["all"]))
    lora.load_lora_into(target, weights, adapter_name="default")
    _same_output(target, model, "target vs model")
    assert all(lora.adapter_layers(target)[p].lora_alpha["default"] == 2.0 for p in lora.adapter_layers(target))
    resaved = lora.read_lora_file(lora.save_lora(tmp_path / "r.safetensors", target,
                                                 lora.LoraSpec(rank=4, alpha=2.0, targets="all"),
                                                 base_identity="t", steps=4))
    for name, delta in _deltas(weights).items():
        assert_close_fp32(lora.lora_delta(resaved, name), delta, ops=LORA_DELTA_ROUNDINGS, what=f"{name} resaved")
    assert all(lora.lora_delta(resaved, n).abs().max() == 0 for n in resaved.layers if n not in weights.layers)

    narrow = _fresh(base)
    lora.inject_lora(narrow, lora.LoraSpec(rank=4, alpha=4.0, targets=("to_q",)))
    with pytest.raises(ValueError, match="does not target"):
        lora.load_lora_into(narrow, weights, adapter_name="default")
    other_rank = _fresh(base)
    lora.inject_lora(other_rank, lora.LoraSpec(rank=8, alpha=4.0, targets="attn"))
    with pytest.raises(ValueError, match="file rank 4, adapter rank 8"):
        lora.load_lora_into(other_rank, weights, adapter_name="default")


def _layout(comfy_state, layout, scale):
    """Rewrite our file's tensors in another layout; layouts without alpha fold the scale into up/B."""
    state = {}
    for key, value in comfy_state.items():
        p = key.removeprefix("diffusion_model.")
        if p.endswith(".alpha"):
            module, kind = p.removesuffix(".alpha"), "alpha"
        else:
            module, _, kind = p.rpartition(".lora_")
            kind = kind.removesuffix(".weight")  # "down" / "up"
        under = module.replace(".", "_")
        with_alpha = layout in ("comfy", "bare", "kohya", "lycoris", "peft-alpha", "transformer-alpha")
        if kind == "alpha":
            if with_alpha:
                state[{"comfy": key, "bare": p, "kohya": f"lora_unet_{under}.alpha",
                       "lycoris": f"lycoris_{under}.alpha", "peft-alpha": p,
                       "transformer-alpha": f"transformer.{p}"}[layout]] = value
            continue
        tensor = value if with_alpha or kind == "down" else value * scale
        kohya = {"down": "lora_down", "up": "lora_up"}[kind]
        peft = {"down": "lora_A", "up": "lora_B"}[kind]
        state[{"comfy": key, "bare": p, "kohya": f"lora_unet_{under}.{kohya}.weight",
               "lycoris": f"lycoris_{under}.{kohya}.weight", "kohya-no-alpha": f"lora_unet_{under}.{kohya}.weight",
               "peft": f"{module}.{peft}.weight", "peft-alpha": f"{module}.{peft}.weight",
               "transformer": f"transformer.{module}.{peft}.weight",
               "transformer-alpha": f"transformer.{module}.{peft}.weight",
               "peft-default": f"{module}.{peft}.default.weight",
               "base-model": f"base_model.model.{module}.{peft}.default.weight",
               "mochi": f"{module}.{peft}"}[layout]] = tensor
    return state


LAYOUTS = ["comfy", "bare", "kohya", "lycoris", "kohya-no-alpha", "peft", "peft-alpha", "transformer",
           "transformer-alpha", "peft-default", "base-model", "mochi"]
COMFY_LOADS = set(LAYOUTS) - {"base-model"}  # ComfyUI has no base_model.model. prefix


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_back_to_the_same_weights(base, tmp_path, layout):
    model, spec = _trained(base)
    ours = lora.lora_state_dict_comfy(model)
    expected = _deltas(lora.parse_lora_state_dict(ours))
    state = _layout(ours, layout, spec.alpha / spec.rank)
    save_file(state, tmp_path / "x.safetensors")
    weights = lora.check_against(base, lora.read_lora_file(tmp_path / "x.safetensors"))
    assert set(weights.layers) == set(lora.adapter_layers(model))
    for name, delta in expected.items():
        assert_close_fp32(lora.lora_delta(weights, name), delta, ops=LORA_DELTA_ROUNDINGS, what=f"{name} ({layout})")
    fresh = _fresh(base)
    lora.load_lora_into(fresh, weights, adapter_name="x")
    _same_output(fresh, model, "fresh vs model")
    if layout in COMFY_LOADS:  # and stock ComfyUI agrees on what the file means
        patched, not_loaded, _ = _comfy_apply(base, state)
        assert not_loaded == []
        _same_output(patched, model, f"ComfyUI-patched ({layout}) vs trained")


# -- bad files ------------------------------------------------------------------------------------------------
def _write(tmp_path, name, state):
    save_file(state, tmp_path / name)
    return tmp_path / name


def test_bad_files_are_named(base, tmp_path):
    q = "transformer_blocks.0.attn.to_q"
    with pytest.raises(ValueError, match=r"no known LoRA layout: \['some.weird.key'\].*accepted layouts"):
        lora.read_lora_file(_write(tmp_path, "u.safetensors", {"some.weird.key": torch.zeros(2)}))
    with pytest.raises(ValueError, match=rf"'diffusion_model.{q}.lora_down.weight' has no lora_up/lora_B partner"):
        lora.read_lora_file(_write(tmp_path, "half.safetensors",
                                   {f"diffusion_model.{q}.lora_down.weight": torch.zeros(4, 32)}))
    with pytest.raises(ValueError, match=rf"'{q}.lora_B.weight' has no lora_down/lora_A partner"):
        lora.read_lora_file(_write(tmp_path, "half2.safetensors", {f"{q}.lora_B.weight": torch.zeros(32, 4)}))
    with pytest.raises(ValueError, match=rf"'{q}.alpha' has no lora_up/lora_B partner"):
        lora.read_lora_file(_write(tmp_path, "alpha.safetensors", {f"{q}.alpha": torch.tensor(4.0)}))
    with pytest.raises(ValueError, match=r"lora_down.weight' is \(4, 32\).*\(32, 3\).*same r"):
        lora.read_lora_file(_write(tmp_path, "r.safetensors", {f"{q}.lora_down.weight": torch.zeros(4, 32),
                                                               f"{q}.lora_up.weight": torch.zeros(32, 3)}))
    with pytest.raises(ValueError, match="both give the down weight"):
        lora.read_lora_file(_write(tmp_path, "dup.safetensors", {
            f"{q}.lora_down.weight": torch.zeros(4, 32), f"{q}.lora_up.weight": torch.zeros(32, 4),
            f"transformer.{q}.lora_A.weight": torch.zeros(4, 32)}))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        lora.read_lora_file(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        lora.read_lora_file(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("kind, value", [("lora_up", float("nan")), ("lora_down", float("inf")),
                                         ("alpha", float("nan"))])
def test_non_finite_lora_files_are_refused_naming_the_key(tmp_path, kind, value):
    q = "diffusion_model.transformer_blocks.0.attn.to_q"
    state = {f"{q}.lora_down.weight": torch.ones(4, 32), f"{q}.lora_up.weight": torch.ones(32, 4),
             f"{q}.alpha": torch.tensor(4.0)}
    key = f"{q}.alpha" if kind == "alpha" else f"{q}.{kind}.weight"
    state[key] = state[key].clone()
    state[key].reshape(-1)[-1] = value
    with pytest.raises(ValueError, match=rf"'{key}' holds NaN or Inf"):
        lora.read_lora_file(_write(tmp_path, "nan.safetensors", state))


def test_loras_for_other_models_are_refused_with_expected_shapes(base, tmp_path):
    q = "transformer_blocks.0.attn.to_q"
    big = lora.read_lora_file(_write(tmp_path, "big.safetensors", {
        f"diffusion_model.{q}.lora_down.weight": torch.zeros(4, 3072),
        f"diffusion_model.{q}.lora_up.weight": torch.zeros(3072, 4)}))
    with pytest.raises(ValueError, match=rf"another model.*{q}: down \(4, 3072\) / up \(3072, 4\), expected down "
                                         r"\(r, 32\) / up \(32, r\)"):
        lora.load_lora_into(_fresh(base), big)
    flux = lora.read_lora_file(_write(tmp_path, "flux.safetensors", {
        "diffusion_model.single_blocks.0.linear1.lora_down.weight": torch.zeros(4, 32),
        "diffusion_model.single_blocks.0.linear1.lora_up.weight": torch.zeros(32, 4)}))
    with pytest.raises(ValueError, match="single_blocks.0.linear1: no such module"):
        lora.check_against(base, flux)
    kohya = lora.read_lora_file(_write(tmp_path, "k.safetensors", {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 32),
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(32, 4)}))
    with pytest.raises(ValueError, match="double_blocks_0_img_attn_qkv.*another model"):
        lora.check_against(base, kohya)


# -- several LoRAs, strengths, merge --------------------------------------------------------------------------
def test_apply_loras_with_strengths_merge_and_unmerge(base, tmp_path):
    a, spec = _trained(base, seed=1)
    b, _ = _trained(base, targets="attn", seed=2)
    wa = lora.read_lora_file(lora.save_lora(tmp_path / "a.safetensors", a, spec, base_identity="t", steps=1))
    wb = lora.read_lora_file(lora.save_lora(tmp_path / "b.safetensors", b, spec, base_identity="t", steps=1))
    expected = _fresh(base)
    with torch.no_grad():
        for name, module in expected.named_modules():
            if name in wa.layers:
                module.weight += 0.5 * lora.lora_delta(wa, name)
            if name in wb.layers:
                module.weight += lora.lora_delta(wb, name)
    model = _fresh(base)
    names = lora.apply_loras(model, [(wa, 0.5), (wb, 1.0)])
    assert len(set(names)) == 2
    _same_output(model, expected, "model vs expected")
    # ComfyUI with the same two files at the same strengths gives the same model.
    comfy, _, _ = _comfy_apply(base, load_file(tmp_path / "a.safetensors"), strength=0.5)
    comfy, _, _ = _comfy_apply(comfy, load_file(tmp_path / "b.safetensors"), strength=1.0)
    _same_output(model, comfy, "model vs comfy")

    base_weight = model.transformer_blocks[0].attn.to_q.base_layer.weight.detach().clone()
    lora.merge_lora(model)
    assert not torch.equal(model.transformer_blocks[0].attn.to_q.base_layer.weight, base_weight)
    _same_output(model, expected, "model vs expected")
    lora.unmerge_lora(model)
    # W + d - d: two roundings of the weight's size
    assert_close_fp32(model.transformer_blocks[0].attn.to_q.base_layer.weight, base_weight, ops=2,
                      what="to_q weight after merge and unmerge")
    _same_output(model, expected, "model vs expected")

    # Re-applying reuses the loaded adapters; other stacks switch without reloading.
    adapters = set(model.peft_config)
    assert lora.apply_loras(model, [(wb, 1.0)]) == names[1:]
    assert set(model.peft_config) == adapters
    only_b = _fresh(base)
    lora.load_lora_into(only_b, wb, adapter_name="b")
    _same_output(model, only_b, "model vs only_b")
    lora.merge_lora(model)  # switching while merged unmerges first
    lora.apply_loras(model, [(wa, 0.0)])
    # unmerging subtracts the delta merging added: the base weights come back up to a rounding (W + d - d)
    _same_output(model, base, "unmerged at strength 0 vs base")
    lora.apply_loras(model, [])
    _same_output(model, base, "unmerged, no LoRA vs base")
    lora.apply_loras(model, [(wa, 0.5), (wb, 1.0)])
    _same_output(model, expected, "model vs expected")


def test_load_lora_into_stacks_with_strength(base, tmp_path):
    a, spec = _trained(base, seed=1)
    wa = lora.read_lora_file(lora.save_lora(tmp_path / "a.safetensors", a, spec, base_identity="t", steps=1))
    model = _fresh(base)
    lora.load_lora_into(model, wa, adapter_name="a", strength=0.0)
    assert torch.equal(_output(model), _output(base))
    lora.load_lora_into(model, wa, adapter_name="b", strength=1.0)  # beside "a", both active
    assert model.active_adapters() == ["a", "b"]
    _same_output(model, a, "model vs a")
    path = tmp_path / "a.safetensors"
    lora.activate(model, [(str(path), 0.0)])
    assert torch.equal(_output(model), _output(base))
    lora.activate(model, [(str(path), 1.0)])
    _same_output(model, a, "model vs a")
    lora.activate(model, [])
    assert torch.equal(_output(model), _output(base))


# -- diffusers' loader ----------------------------------------------------------------------------------------
def test_diffusers_lora_loader_gives_the_same_transformer(base, tmp_path):
    """QwenImageLoraLoaderMixin.lora_state_dict folds alpha/rank into lora_A/lora_B; loaded with scale 1 the
    transformer computes what ours does (every target kind, attention and MLP, survives the conversion)."""
    model, spec = _trained(base)
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="t", steps=1)
    state = QwenImageEditPipeline.lora_state_dict(str(path))
    assert len(state) == 2 * len(lora.adapter_layers(model))
    fresh = _fresh(base)
    QwenImageEditPipeline.load_lora_into_transformer(state, transformer=fresh, adapter_name="d")
    assert len(lora.adapter_layers(fresh, "d")) == 12 + 9
    _same_output(fresh, model, "fresh vs model")


def test_pipeline_load_lora_weights_matches_ours(tiny_edit_dir, tmp_path):
    """The user-facing call: `QwenImageEditPipeline.load_lora_weights(file)` on a pipeline."""
    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_dir)
    model, spec = _trained(pipe.transformer.eval())
    path = lora.save_lora(tmp_path / "l.safetensors", model, spec, base_identity="t", steps=1)
    pipe.load_lora_weights(str(path))
    _same_output(pipe.transformer, model, "pipe.transformer vs model")


def test_diffusers_load_lora_weights_reproduces_our_sampler_image(tiny_edit_dir, tmp_path, small_edit_area):
    """The issue's contract, end to end: diffusers' QwenImageEditPipeline with `load_lora_weights(our file)`
    gives our sampler's image with the same LoRA (fp32, CPU, parity tolerance)."""
    import numpy as np
    from diffusers import QwenImageEditPipeline
    from PIL import Image

    from qwen_edit_core.sample import sampler
    from qwen_edit_core.model.components import load_components, load_transformer
    from qwen_edit_core.model.devices import DevicePlan
    trained = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=lora.TARGET_PRESETS["all"])
    torch.manual_seed(0)
    lora.inject_lora(trained, spec)
    with torch.no_grad():
        for layer in lora.adapter_layers(trained).values():
            layer.lora_B["default"].weight.normal_(0, 0.05)
    path = lora.save_lora(tmp_path / "l.safetensors", trained, spec, base_identity="t", steps=1)

    comps = load_components(tiny_edit_dir, DevicePlan.from_mapping({}))
    lora.load_lora_into(comps.transformer, lora.read_lora_file(path), adapter_name="mine")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    settings = sampler.SampleSettings(num_inference_steps=3, true_cfg_scale=3.0, seed=4, width=128, height=128,
                                      vae_area=small_edit_area)
    ours = sampler.sample(comps, "invert", [image], settings)[0].numpy()
    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_dir)
    pipe.load_lora_weights(str(path))
    ref = pipe(image=image, prompt="invert", negative_prompt=" ", true_cfg_scale=3.0, num_inference_steps=3,
               height=128, width=128, generator=torch.Generator("cpu").manual_seed(4), output_type="np").images[0]
    assert_close_fp32(torch.from_numpy(ours), torch.from_numpy(ref), ops=TINY_SAMPLER_ROUNDINGS,
                      what="our picture with the LoRA vs diffusers'")
