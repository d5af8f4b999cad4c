"""Stock LATENTs in a real ComfyUI: a Qwen-Image VAE file (ComfyUI's own WanVAE class at the real size, seeded
random weights, written by ComfyUI's Python) is loaded both by the pack (Load Model's vae_file) and by stock
VAELoader. The pack's Encode Image and Sampler latents decode with stock VAE Decode to the pack's own pictures
(within 2/255), and stock VAE Encode's latent equals the pack's and decodes with Decode Latent."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from comfy import ComfyServer

VAE_NAME = "qwen_vae_random_check.safetensors"
TOLERANCE = 2  # of 255

# Runs in ComfyUI's Python, in its checkout: the real-size Qwen-Image VAE (ComfyUI's Wan 2.1 VAE class, the one
# comfy/sd.py builds for a qwen_image_vae file), seeded weights, saved in ComfyUI's own key layout.
WRITE_VAE = """
import sys, torch
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()  # as main.py does: --cpu, no CUDA probing
from safetensors.torch import save_file
import comfy.ldm.wan.vae as wan
torch.manual_seed(0)
vae = wan.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0)
with torch.no_grad():
    for name, p in vae.named_parameters():
        if name.endswith("gamma"):
            p.fill_(1.0)
        elif p.ndim == 1:
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape) / (p[0].numel() ** 0.5))
save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, sys.argv_path)
"""


def _write_vae(server: ComfyServer, python: str) -> Path:
    path = server.base / "models" / "vae" / VAE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    code = WRITE_VAE.replace("sys.argv_path", repr(str(path)))
    subprocess.run([python, "-c", code], cwd=server.comfyui_dir, check=True, timeout=600)
    return path


def _prompt() -> dict:
    model, image, vae = ["1", 0], ["2", 1], ["5", 0]
    sampler = {"model": model, "image": image, "prompt": "invert the colors", "negative_prompt": " ", "steps": 2,
               "true_cfg_scale": 4.0, "seed": 0, "width": 0, "height": 0, "shift_mode": "dynamic",
               "uncond_device": "same", "vae_side": 64}
    nodes = {
        "1": ("QwenEditModelLoader", {"model": "qwen-edit-tiny (built-in, random weights)", "dtype": "float32",
                                      "transformer_device": "cpu", "vae_device": "cpu", "text_encoder_device": "cpu",
                                      "vae_file": VAE_NAME}),
        "2": ("QwenEditSyntheticDataset", {"folder": "latent_check_pairs", "count": 2, "seed": 0}),
        "3": ("QwenEditEncodeImage", {"model": model, "image": image, "vae_side": 64}),
        "4": ("QwenEditDecodeLatent", {"model": model, "latent": ["3", 0]}),
        "5": ("VAELoader", {"vae_name": VAE_NAME}),
        "6": ("VAEDecode", {"samples": ["3", 1], "vae": vae}),
        "7": ("VAEEncode", {"pixels": image, "vae": vae}),
        "8": ("QwenEditDecodeLatent", {"model": model, "samples": ["7", 0]}),
        "9": ("QwenEditSampler", sampler),
        "10": ("VAEDecode", {"samples": ["9", 1], "vae": vae}),
    }
    saves = {"ours": ["4", 0], "stock_decode": ["6", 0], "ours_from_stock_encode": ["8", 0],
             "sampler": ["9", 0], "sampler_stock_decode": ["10", 0]}
    for i, (prefix, source) in enumerate(saves.items()):
        nodes[f"s{i}"] = ("SaveImage", {"images": source, "filename_prefix": f"latent_check/{prefix}"})
    nodes["l1"] = ("SaveLatent", {"samples": ["3", 1], "filename_prefix": "latent_check/ours"})
    nodes["l2"] = ("SaveLatent", {"samples": ["7", 0], "filename_prefix": "latent_check/stock"})
    return {k: {"class_type": t, "inputs": i} for k, (t, i) in nodes.items()}


def _picture(server: ComfyServer, prefix: str):
    import numpy as np
    from PIL import Image
    (path,) = sorted((server.base / "output" / "latent_check").glob(f"{prefix}_0*.png"))
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def _latent(server: ComfyServer, prefix: str):
    from safetensors.torch import load_file
    (path,) = sorted((server.base / "output" / "latent_check").glob(f"{prefix}_0*.latent"))
    return load_file(str(path))["latent_tensor"].float()


def check_latents(args) -> list[str]:
    server = ComfyServer(args.comfyui_dir, args.python, log_dir=args.out)
    _write_vae(server, args.python)
    with server:
        server.run(_prompt())
        diffs = {}
        for ours, stock in (("ours", "stock_decode"), ("sampler", "sampler_stock_decode"),
                            ("ours", "ours_from_stock_encode")):
            a, b = _picture(server, ours), _picture(server, stock)
            assert a.shape == b.shape, f"{ours} {a.shape} vs {stock} {b.shape}"
            diffs[f"{ours} vs {stock}"] = int(abs(a - b).max())
        latent_ours, latent_stock = _latent(server, "ours"), _latent(server, "stock")
    assert latent_ours.shape == latent_stock.shape, (latent_ours.shape, latent_stock.shape)
    latent_diff = float((latent_ours - latent_stock).abs().max())
    scale = float(latent_stock.abs().max())
    assert all(d <= TOLERANCE for d in diffs.values()), f"pictures differ by more than {TOLERANCE}/255: {diffs}"
    assert latent_diff <= 1e-3 * max(scale, 1.0), f"latents differ by {latent_diff} (scale {scale})"
    return [f"stock LATENT round trip with ComfyUI's Qwen-Image VAE class: max pixel differences {json.dumps(diffs)} "
            f"(of 255); Encode Image vs VAE Encode latents {tuple(latent_ours.shape)}: max |diff| {latent_diff:.2e} "
            f"(values up to {scale:.2f})"]
