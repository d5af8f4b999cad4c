"""Validation during training: sample the config's prompt + control image every N steps, and (for datasets
with masks) the loss inside and outside the edited regions.

The conditioning comes from the embedding cache like any training sample (so training from the cache still
loads no encoder); the sampled latents are written to `validation/step-N.safetensors` and decoded to PNG
when a VAE is at hand: at once in realtime mode, after training in cached mode.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qwen_edit_core.model import encode
from qwen_edit_core.sample import sampler
from qwen_edit_core.data.dataset import EditExample, check_image
from qwen_edit_core.model.encode import PromptEmbeds

log = logging.getLogger(__name__)


def validation_example(image: str, prompt: str, n_controls: int) -> EditExample:
    """The validation input as a cacheable example (its own image stands in as target)."""
    path = Path(image)
    size, problem = check_image(path, min_side=16, max_pixels=64_000_000, convert_modes=True)
    if problem:
        raise ValueError(f"train.validation_image {str(path)!r}: {problem}")
    if not prompt:
        raise ValueError("train.validation_prompt is empty: give the edit instruction to validate with")
    return EditExample("validation", path, (path,) * n_controls, prompt, size, (size,) * n_controls)


def conditioning_from_entry(tensors: dict, device, dtype) -> sampler.Conditioning:
    """Sampler conditioning from a cache entry: the caption's embeddings, the empty caption as negative."""
    shapes = [tuple(s) for s in tensors["img_shapes"].tolist()]
    n = len(shapes) - 1
    control = torch.cat([encode.pack(tensors[f"control_latents_{i}"][None]) for i in range(n)], dim=1)
    _, rows, cols = shapes[0]
    return sampler.Conditioning(cond=encode.pad_embeddings([tensors["prompt_embeds"]]).to(device, dtype),
                                uncond=encode.pad_embeddings([tensors["empty_prompt_embeds"]]).to(device, dtype),
                                control_tokens=control.to(device, dtype), img_shapes=shapes,
                                width=cols * encode.LATENT_MULTIPLE, height=rows * encode.LATENT_MULTIPLE)


class Validator:
    """Callable(step): sample the validation input with the training transformer; keeps the latents."""

    def __init__(self, components, tensors: dict, out_dir: Path, *, steps: int, cfg: float, seed: int):
        self.components, self.tensors, self.out_dir = components, tensors, out_dir / "validation"
        self.settings = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=cfg, negative_prompt="",
                                               seed=seed)
        self.latent_files: list[Path] = []
        self.images: list[Path] = []

    def __call__(self, step: int, write: bool = True) -> Path | None:
        """Sample at `step`; `write=False` takes part in the sampling (sharded training needs every process)
        without writing anything."""
        transformer = self.components.transformer
        param = next(transformer.parameters())
        cond = conditioning_from_entry(self.tensors, param.device, transformer.img_in.weight.dtype)
        transformer.eval()
        latents = sampler.denoise(self.components, cond, self.settings)
        if not write:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"step-{step:07d}.safetensors"
        save_file({"latents": latents.cpu().contiguous(),
                   "size": torch.tensor([cond.width, cond.height])}, path)
        self.latent_files.append(path)
        if self.components.vae is not None:
            self.images.append(decode_file(self.components.vae, path))
        log.info("validation at step %d -> %s", step, path)
        return path

    def decode_pending(self, vae) -> list[Path]:
        """Decode latents saved while no VAE was loaded (cached mode)."""
        done = {p.with_suffix("") for p in self.images}
        self.images += [decode_file(vae, p) for p in self.latent_files if p.with_suffix("") not in done]
        return self.images


def decode_file(vae, path: Path) -> Path:
    from PIL import Image
    data = load_file(path)
    width, height = data["size"].tolist()
    pixels = encode.decode_latents(vae, encode.unpack(data["latents"], height, width))
    image = (encode.postprocess(pixels)[0].numpy() * 255).round().astype("uint8")
    png = path.with_suffix(".png")
    Image.fromarray(image).save(png)
    return png


class RegionLosses:
    """Callable(transformer, step): the loss inside and outside the edited regions of up to `limit` masked
    pairs, with fixed noise and sigmas (so steps compare), logged and appended to
    `validation/region_loss.csv` (step, masked_loss, unmasked_loss)."""

    def __init__(self, items: list[dict], config, scheduler_config: dict, out_dir: Path):
        self.items, self.config, self.scheduler_config = items, config, scheduler_config
        self.csv = out_dir / "validation" / "region_loss.csv"
        self.history: list[tuple[int, float, float]] = []

    def __call__(self, transformer, step: int, write: bool = True) -> tuple[float, float]:
        from qwen_edit_core.train.batch import collate, region_losses, sample_generator
        param = next(transformer.parameters())
        gens = [sample_generator(self.config.train.seed, 0, 0, j) for j in range(len(self.items))]
        batch = collate(self.items, gens, caption_dropout=0.0, control_dropout=0.0, device=param.device,
                        dtype=transformer.img_in.weight.dtype)
        transformer.eval()
        masked, unmasked = region_losses(transformer, batch, self.config, self.scheduler_config)
        self.history.append((step, masked, unmasked))
        if not write:
            return masked, unmasked
        self.csv.parent.mkdir(parents=True, exist_ok=True)
        new = not self.csv.is_file()
        with open(self.csv, "a", encoding="utf-8") as fh:
            fh.write(("step,masked_loss,unmasked_loss\n" if new else "") + f"{step},{masked:.8g},{unmasked:.8g}\n")
        log.info("validation at step %d: masked-region loss %.6f, unmasked loss %.6f", step, masked, unmasked)
        return masked, unmasked


__all__ = ["PromptEmbeds", "RegionLosses", "Validator", "conditioning_from_entry", "decode_file", "validation_example"]
