"""Validation during training: sample the config's prompt + control image every N steps, in one or several
previews (named schedules, steps, CFG, LoRA files stacked for a preview only) shown side by side, and (for
datasets with masks) the loss inside and outside the edited regions.

The conditioning comes from the embedding cache like any training sample (so training from the cache still
loads no encoder); the sampled latents are written to `validation/step-0000012.safetensors` and decoded to PNG
when a VAE is at hand: at once in realtime mode, after training in cached mode.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file

from qwen_edit_core.model import encode
from qwen_edit_core.families import family_of
from qwen_edit_core.config import ValidationPreview
from qwen_edit_core.sample import sampler, schedules
from qwen_edit_core.data.dataset import EditExample, check_image
from qwen_edit_core.model.encode import PromptEmbeds
from qwen_edit_core.families.templates import EMPTY_PROMPT
from qwen_edit_core.common.files import save_png, save_safetensors, writing
from qwen_edit_core.train.checkpoint import survivor

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


@dataclass(frozen=True)
class Preview:
    """One validation preview: its grid label, sampler settings and LoRA files ((path, strength)) for it only."""

    label: str
    settings: sampler.SampleSettings
    loras: tuple[tuple[str, float], ...] = ()


def previews_from_config(config) -> list[Preview]:
    """The previews of `train.validation_previews` (empty: one with `predict.schedule`); steps and CFG not
    given are the schedule's (lightning: 4 and 1.0), else train.validation_steps and predict.true_cfg_scale.
    Every problem of every preview (a setting out of range, a LoRA file missing) is reported at once."""
    items = config.train.validation_previews or (ValidationPreview(schedule=config.predict.schedule,
                                                                   shift=config.predict.shift),)
    previews, problems = [], []
    for number, item in enumerate(items, 1):
        where = f"train.validation_previews[{number - 1}]"
        try:
            grid, preset_cfg = schedules.resolve_sigmas(item.sigmas)
        except ValueError as err:
            problems.append(f"{where}: {err}")
            grid, preset_cfg = None, None
        steps, cfg = schedules.steps_and_cfg(item.schedule, len(grid) if grid else item.steps,
                                             item.cfg if item.cfg is not None else preset_cfg,
                                             config.train.validation_steps, config.predict.true_cfg_scale)
        settings = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=cfg, negative_prompt=EMPTY_PROMPT,
                                          seed=config.train.seed, schedule=item.schedule, shift=item.shift, sigmas=grid)
        try:
            settings.validate()
        except ValueError as err:
            problems.append(f"{where}: {err}")
        loras = tuple((lora.path, float(lora.strength)) for lora in item.loras)
        problems += [f"{where}: LoRA file {path!r} does not exist" for path, _ in loras if not Path(path).is_file()]
        label = (f"sigmas {item.sigmas}" if isinstance(item.sigmas, str) and item.sigmas else
                 f"{item.schedule} {steps} steps{' (sigma list)' if grid else ''}") + f", CFG {cfg:g}"
        previews.append(Preview(item.label or label, settings, loras))
    if problems:
        raise ValueError(_problems("validation previews", problems))
    return previews


def _problems(what: str, problems: list[str]) -> str:
    return f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(problems)


def parse_lora_lines(text: str, resolve=Path) -> list[dict]:
    """`FILE[:STRENGTH]` per line (or comma-separated) -> [{path, strength}] for model.lora.stack; `resolve`
    turns a name into a path (e.g. a name in ComfyUI's loras folder). A strength that is not a number is an
    error (all of them at once), not part of a file name."""
    items, problems = [], []
    for part in (p.strip() for line in text.splitlines() for p in line.split(",")):
        if part:
            item, problem = _lora_item(part, resolve, check_file=False)
            items += [item] if item else []
            problems += [problem] if problem else []
    if problems:
        raise ValueError(_problems("LoRA list", problems))
    return items


def _lora_item(spec: str, resolve, check_file: bool = True) -> tuple[dict | None, str | None]:
    """`FILE[:STRENGTH]` -> ({path, strength}, None) or (None, what is wrong). An existing file's whole name wins
    (a name may hold ':'); otherwise the text after the last ':' must be a finite number."""
    name, strength = spec, 1.0
    if ":" in spec and not _exists(spec, resolve):
        head, _, tail = spec.rpartition(":")
        try:
            strength = float(tail)
        except ValueError:
            strength = None
        if strength is None or not math.isfinite(strength) or not head:
            return None, (f"lora {spec!r}: {tail!r} after the last ':' is not a strength (a finite number) and no "
                          f"file is called {spec!r}; write FILE or FILE:STRENGTH, e.g. FILE:0.8")
        name = head.strip()
    try:
        path = resolve(name)
    except (OSError, ValueError) as err:  # ComfyUI's folder lookup raises for an unknown name
        return None, f"lora {name!r}: {err}"
    if check_file and not Path(path).is_file():
        return None, f"lora {name!r}: no such file ({str(path)!r}); give a LoRA file's path or name"
    return {"path": str(path), "strength": strength}, None


def _exists(name: str, resolve) -> bool:
    try:
        return Path(resolve(name)).is_file()
    except (OSError, ValueError):
        return False


#: key -> (parse the value or raise ValueError, what is accepted)
PREVIEW_KEYS = {
    "steps": (lambda v: _checked(int(v), lambda x: x >= 1), "a whole number >= 1"),
    "cfg": (lambda v: _checked(float(v), lambda x: math.isfinite(x) and x >= 0), "a finite number >= 0 (<= 1: no CFG)"),
    "shift": (lambda v: _checked(float(v), lambda x: math.isfinite(x) and x > 0), "a finite number > 0"),
    "label": (lambda v: _checked(v.replace("_", " "), bool), "a non-empty text (_ for spaces)"),
    "sigmas": (lambda v: v if v in schedules.SIGMA_PRESETS else schedules.check_sigmas(v.split(",")),
               f"a preset ({', '.join(schedules.SIGMA_PRESETS)}) or decreasing sigmas in (0, 1] joined by commas"),
}


def _checked(value, ok):
    if not ok(value):
        raise ValueError(value)
    return value


def parse_previews(text: str | Sequence[str], resolve=Path) -> list[dict]:
    """Previews `SCHEDULE [steps=N] [cfg=X] [shift=S] [lora=FILE[:STRENGTH]]... [label=TEXT]` (e.g. `lightning
    steps=4 lora=Qwen-Image-Edit-Lightning-4steps.safetensors`) -> dicts for train.validation_previews. A string
    holds one per line (blank lines skipped: a text box); a list holds one per item (the CLI's --preview: an empty
    one is an error). LoRA names go through `resolve` and must be files. Every problem of every preview (a
    schedule or key not accepted, a value out of range, a key given twice, a strength that is not a number, a
    missing file) is reported at once, naming the preview, the key and what is accepted, in one ValueError."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()] if isinstance(text, str) \
        else list(enumerate(text, 1))
    previews, problems = [], []
    for number, line in lines:
        item, found = _parse_preview(line, resolve)
        previews.append(item)
        problems += [f"preview {number} {line!r}: {problem}" for problem in found]
    if problems:
        raise ValueError(_problems("validation previews", problems))
    return previews


def _parse_preview(line: str, resolve) -> tuple[dict, list[str]]:
    """One preview's dict and its problems."""
    words, problems = line.split(), []
    accepted = f"accepted: {', '.join(schedules.SCHEDULES)}"
    if not words:
        return {}, [f"empty; give SCHEDULE [key=value]... ({accepted})"]
    if words[0] not in schedules.SCHEDULES:
        problems.append(f"the first word {words[0]!r} is not a schedule; {accepted}")
    item: dict = {"schedule": words[0], "loras": []}
    seen: dict[str, str] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in (*PREVIEW_KEYS, "lora"):
            problems.append(f"{word!r} is not key=value with a key among {', '.join((*PREVIEW_KEYS, 'lora'))}")
        elif key == "lora":
            lora, problem = _lora_item(value, resolve) if value else (None, "lora= names no file")
            item["loras"] += [lora] if lora else []
            problems += [problem] if problem else []
        elif key in seen:
            problems.append(f"{key} is given twice ({key}={seen[key]} and {word}); give each key once")
        else:
            seen[key] = value
            parse, what = PREVIEW_KEYS[key]
            try:
                item[key] = parse(value)
            except ValueError:
                problems.append(f"{key} {value!r} is not {what}")
    return item, problems


class Validator:
    """Callable(step): sample the validation input with the training transformer in every preview; keeps the
    latents (one file per step, a labelled grid image per step once decoded)."""

    def __init__(self, components, tensors: dict, out_dir: Path, previews: list[Preview],
                 stack: tuple[tuple[str, float], ...] = ()):
        self.components, self.tensors, self.out_dir = components, tensors, out_dir / "validation"
        self.previews, self.stack = previews, tuple(stack)
        self.latent_files: list[Path] = []
        self.images: list[Path] = []

    def __call__(self, step: int, write: bool = True) -> Path | None:
        """Sample every preview at `step`; `write=False` takes part in the sampling (sharded training needs every
        process) without writing anything."""
        from qwen_edit_core.adapters import lora
        transformer = self.components.transformer
        param = next(transformer.parameters())
        family = family_of(self.tensors)  # the entry's family samples it (families/<family>/sampler.py)
        sampling = family.stage("sampler")
        cond = sampling.conditioning_from_entry(self.tensors, param.device, transformer.img_in.weight.dtype)
        transformer.eval()
        tensors = {"size": torch.tensor([cond.width, cond.height])}
        try:
            for i, preview in enumerate(self.previews):
                sampling.check_settings(preview.settings)
                if preview.loras:
                    lora.activate_with_trained(transformer, self.stack + preview.loras)
                tensors[f"latents_{i}"] = sampling.denoise(self.components, cond, preview.settings).cpu().contiguous()
                if preview.loras:
                    lora.activate_with_trained(transformer, self.stack)
        finally:
            transformer.train()
        if not write:
            return None
        path = self.out_dir / f"step-{step:07d}.safetensors"
        with writing(path, f"the validation picture of step {step}",
                     lambda: survivor(self.out_dir.parent / "checkpoints"), key="train.output_dir"):
            save_safetensors(tensors, path, metadata={"labels": json.dumps([p.label for p in self.previews]),
                                                      "family": family.cache_name})
            self.latent_files.append(path)
            if self.components.vae is not None:
                self.images.append(decode_file(self.components.vae, path))
        log.info("validation at step %d (%s) -> %s", step, ", ".join(p.label for p in self.previews), path)
        return path

    def decode_pending(self, vae) -> list[Path]:
        """Decode latents saved while no VAE was loaded (cached mode)."""
        done = {p.with_suffix("") for p in self.images}
        self.images += [decode_file(vae, p) for p in self.latent_files if p.with_suffix("") not in done]
        return self.images


def decode_file(vae, path: Path) -> Path:
    """A validation latents file -> PNG beside it: the previews side by side, each labelled above its image."""
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        labels = json.loads((f.metadata() or {}).get("labels", "[]"))
        unpack = family_of(f.metadata() or {}).stage("sampler").unpack
    data = load_file(path)
    width, height = data["size"].tolist()
    images = []
    for i in range(len(labels)):
        pixels = encode.decode_latents(vae, unpack(data[f"latents_{i}"], width, height))
        images.append((encode.postprocess(pixels)[0, ..., :3].numpy() * 255).round().astype("uint8"))
    png = path.with_suffix(".png")
    with writing(png, "a validation picture", lambda: survivor(path.parent.parent / "checkpoints"),
                 key="train.output_dir"):
        save_png(labelled_grid(images, labels), png)
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
                        dtype=transformer.img_in.weight.dtype, family=family_of(transformer))
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


def labelled_grid(images: list, labels: list[str], band: int = 14):
    """(H, W, 3) uint8 arrays side by side on a white canvas, each with its label in a band above it."""
    from PIL import Image, ImageDraw
    height = max(img.shape[0] for img in images)
    canvas = Image.new("RGB", (sum(img.shape[1] for img in images), height + band), "white")
    draw, x = ImageDraw.Draw(canvas), 0
    for img, label in zip(images, labels):
        canvas.paste(Image.fromarray(img), (x, band))
        draw.text((x + 2, 1), label, fill="black")
        x += img.shape[1]
    return canvas


__all__ = ["PromptEmbeds", "Preview", "RegionLosses", "Validator", "decode_file",
           "labelled_grid", "parse_lora_lines", "parse_previews", "previews_from_config", "validation_example"]
