"""Load each model component on its own device and dtype.

Every loader takes an explicit `device=` and `dtype=` and runs under `torch.inference_mode(False)`: ComfyUI
calls nodes inside inference mode, and weights created there are inference tensors that a LoRA cannot be
trained on. The device plan is validated (devices.DevicePlan) before any of these run.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from qwen_edit_core.families import variants
from qwen_edit_core.families import DEFAULT, Family
from qwen_edit_core.model.devices import DeviceError
from qwen_edit_core.model.weight_files import (  # noqa: F401 - re-exported: callers catch it from here
    PICKLE_SUFFIXES, ModelNotFoundError, require_safetensors)

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("none", "int8", "nf4")


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """A local diffusers-layout directory, or a hub id whose files are already in the local HF cache."""
    text = str(name_or_path).strip()
    if not text:
        raise ModelNotFoundError("no model given: set model.pretrained_model_name_or_path to a local "
                                 "Qwen-Image-Edit directory (diffusers layout)")
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ModelNotFoundError(f"{str(path)!r} has no model_index.json: expected a diffusers-layout "
                                     "directory with transformer/, vae/, text_encoder/, tokenizer/, processor/, "
                                     "scheduler/")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{str(path)!r} is a file; expected a diffusers-layout model directory")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
            return Path(snapshot_download(text, local_files_only=True))
        except Exception:  # noqa: BLE001 - any hub failure means "not available offline"
            pass
    raise ModelNotFoundError(f"model {text!r} is neither a local directory nor a hub id in the local Hugging "
                             "Face cache; download it first (huggingface-cli download) or give a local path")


def detect_variant(model_dir: Path) -> str:
    """The variant name (families/variants.py) of a diffusers directory, from model_index.json's pipeline class
    and the transformer's zero_cond_t."""
    try:
        return variants.from_model_dir(model_dir).name
    except variants.UnknownVariantError as err:
        raise ModelNotFoundError(str(err)) from None


def model_identity(model_dir: Path | None, variant: str = "") -> str:
    """What a LoRA file records of the model it was trained on: the variant and the model folder's own name
    (`<variant>:<folder>`, e.g. `<the Edit Plus variant>:Qwen-Image-Edit-2509`), never a path of this machine."""
    if model_dir is None:
        return variant or "unknown"
    return f"{variant or detect_variant(Path(model_dir))}:{Path(model_dir).name}"


def _quantization(mode: str, device: torch.device, component: str, library: str):
    """A bitsandbytes config for `mode`, or None; refuses where the backend cannot run."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"{component}: quantize={mode!r} is not accepted; accepted: {', '.join(QUANTIZE_MODES)}")
    if mode == "none":
        return None
    if device.type != "cuda":
        raise DeviceError(f"{component}: quantize={mode!r} uses bitsandbytes, which needs a CUDA device; "
                          f"{component} is on {device}. Use quantize: none on this device")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise DeviceError(f"{component}: quantize={mode!r} needs bitsandbytes: pip install bitsandbytes") from None
    if library == "diffusers":
        from diffusers import BitsAndBytesConfig
    else:
        from transformers import BitsAndBytesConfig
    if mode == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


def _finish(module: torch.nn.Module, device: torch.device, quantized: bool) -> torch.nn.Module:
    if not quantized:
        module = module.to(device)
    module.eval().requires_grad_(False)
    return module


#: pickle-based weight files: never read (loading a pickle can run code)
def family_of(model_dir: Path) -> Family:
    """The model family (families.py) of a diffusers directory, from model_index.json's pipeline class (the 2025
    family without one, as a bare component folder)."""
    index = Path(model_dir) / "model_index.json"
    if not index.is_file():
        return DEFAULT
    pipeline = json.loads(index.read_text()).get("_class_name", "")
    found = next((v.family for v in variants.VARIANTS.values() if v.pipeline_class == pipeline), None)
    return found or variants.get(detect_variant(model_dir)).family  # unknown: raises naming the accepted classes


def load_transformer(model_dir: Path, *, device: torch.device, dtype: torch.dtype, quantize: str = "none",
                     family: Family | None = None):
    """The family's transformer (its `transformer_class`) from `model_dir/transformer`, frozen, on
    `device` in `dtype`; the family defaults to the directory's."""
    cls = (family or family_of(model_dir)).class_of("transformer")
    qconfig = _quantization(quantize, device, "transformer", "diffusers")
    with torch.inference_mode(False):
        extra = {"quantization_config": qconfig, "device_map": {"": str(device)}} if qconfig else {}
        require_safetensors(Path(model_dir) / "transformer", "transformer")
        model = cls.from_pretrained(model_dir, subfolder="transformer", torch_dtype=dtype,
                                                            use_safetensors=True, **extra)
        return _finish(model, device, qconfig is not None)


def load_vae(model_dir: Path, *, device: torch.device, dtype: torch.dtype, family: Family | None = None,
             vae_file: str | Path | None = None):
    """The family's VAE (its `vae_class`) from `model_dir/vae`, or from `vae_file` (ComfyUI's layouts;
    one of the other family than the directory's is refused), frozen, on `device` in `dtype`; the family
    defaults to the directory's."""
    family = family or family_of(model_dir)
    if vae_file:
        from qwen_edit_core.model import family_files
        family_files.check_file_family({"vae": vae_file}, family, family.name)
        return family_files.load_vae_file(vae_file, model_dir, family, device=device, dtype=dtype)
    cls = family.class_of("vae")
    with torch.inference_mode(False):
        require_safetensors(Path(model_dir) / "vae", "vae")
        model = cls.from_pretrained(model_dir, subfolder="vae", torch_dtype=dtype,
                                                       use_safetensors=True)
        return _finish(model, device, False)


@dataclass(frozen=True)
class TextEncoder:
    """The Qwen2.5-VL model with the processor (tokenizer + image processor) that feeds it."""

    model: torch.nn.Module
    processor: object
    device: torch.device
    #: the single file the weights came from (None: a model directory's text_encoder/)
    weights_file: Path | None = None
    #: the folder the processor came from (a model directory's processor/, or ComfyUI's qwen25_tokenizer)
    processor_dir: Path | None = None


def processor_source(model_dir: Path | None, comfyui_dir: str | Path | None = None) -> Path:
    """The folder the text encoder's processor is read from: `model_dir/processor` when the model directory has
    one, else ComfyUI's bundled Qwen2.5 tokenizer under `comfyui_dir` (the DEFAULT family's text_encoder_file stage
    module's `comfy_tokenizer_dir`: the tokenizer ComfyUI bundles is that family's)."""
    if model_dir is not None and (Path(model_dir) / "processor").is_dir():
        return Path(model_dir) / "processor"
    if comfyui_dir:
        return DEFAULT.stage("text_encoder_file").comfy_tokenizer_dir(comfyui_dir)
    where = f"{str(model_dir)!r} has no processor/" if model_dir is not None else "no model directory was given"
    raise ModelNotFoundError(f"no tokenizer for the text encoder: {where}. Give a diffusers-layout model directory "
                             "with processor/, or a ComfyUI installation whose comfy/text_encoders/qwen25_tokenizer/ "
                             "is used (model.comfyui_dir / --comfyui-dir; found by itself inside ComfyUI and next to "
                             "model.comfyui_models_dir)")


def caption_token_counter(model_dir: Path | None, comfyui_dir: str | Path | None = None):
    """`count(text) -> tokens` of the text encoder's tokenizer alone (`processor_source`; no image processor, no
    weights: milliseconds to load), for checking captions while the dataset is validated; None when the model
    has no tokenizer to read."""
    try:
        source = processor_source(model_dir, comfyui_dir)
    except (ModelNotFoundError, OSError, ValueError):
        return None
    return token_counter(source)


def token_counter(source: Path):
    """`count(text) -> tokens` of the tokenizer saved in the folder `source` (read locally, never downloaded)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    return lambda text: len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def load_processor(model_dir: Path | None, comfyui_dir: str | Path | None = None, family: Family = DEFAULT):
    """The family's processor (its `processor_class`: tokenizer + image processor) from `processor_source`."""
    return read_processor(processor_source(model_dir, comfyui_dir), family)


def read_processor(source: Path, family: Family = DEFAULT):
    """The processor of a folder: a saved processor (diffusers' processor/, with its image-processor settings), or
    bare Qwen2.5 tokenizer files (ComfyUI's qwen25_tokenizer/) given Qwen-Image's image-processor settings."""
    cls = family.class_of("processor")
    if any((Path(source) / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
        return cls.from_pretrained(source)
    return family.stage("text_encoder_file").processor_from_tokenizer_files(source)


def load_text_encoder(model_dir: Path | None, *, device: torch.device, dtype: torch.dtype, quantize: str = "none",
                      text_encoder_file: str | Path | None = None,
                      comfyui_dir: str | Path | None = None, family: Family | None = None) -> TextEncoder:
    """Qwen2.5-VL from `model_dir/text_encoder` (or from one `text_encoder_file`, ComfyUI's text_encoders layout)
    and its processor (`load_processor`: `model_dir/processor`, else ComfyUI's bundled tokenizer); the family
    defaults to the directory's (Qwen-Image 2025 without one). Qwen-Image-2.1 takes no text encoder file."""
    family = family or (family_of(model_dir) if model_dir is not None else DEFAULT)
    if text_encoder_file:
        from qwen_edit_core.model.family_files import check_text_encoder_file
        check_text_encoder_file(text_encoder_file, family)
    cls = family.class_of("text_encoder")
    if text_encoder_file and quantize != "none":
        raise ValueError(f"text_encoder: quantize={quantize!r} is not available for a single text encoder file "
                         f"({text_encoder_file}); use quantize none, or the model directory's text_encoder/")
    source = processor_source(model_dir, comfyui_dir)
    processor = read_processor(source, family)
    if text_encoder_file:
        model = family.stage("text_encoder_file").load_text_encoder_file(text_encoder_file, device=device, dtype=dtype,
                                                                         tokenizer=processor.tokenizer)
        return TextEncoder(model=model, processor=processor, device=device, weights_file=Path(text_encoder_file),
                           processor_dir=source)
    if model_dir is None or not (Path(model_dir) / "text_encoder").is_dir():
        raise ModelNotFoundError(f"no text encoder: {str(model_dir)!r} has no text_encoder/; give a diffusers-layout "
                                 "model directory with one, or a text encoder file (model.text_encoder_file)")
    qconfig = _quantization(quantize, device, "text_encoder", "transformers")
    with torch.inference_mode(False):
        extra = {"quantization_config": qconfig, "device_map": {"": str(device)}} if qconfig else {}
        require_safetensors(Path(model_dir) / "text_encoder", "text_encoder")
        model = cls.from_pretrained(model_dir / "text_encoder", dtype=dtype,
                                                                   use_safetensors=True, **extra)
        model = _finish(model, device, qconfig is not None)
    return TextEncoder(model=model, processor=processor, device=device, processor_dir=source)


#: ComfyUI's model folder of each single-file component
MODEL_FOLDERS = {"transformer": "diffusion_models", "vae": "vae", "text_encoder": "text_encoders"}


def resolve_model_file(value: str | Path | None, component: str, models_dir: str | Path | None = None) -> Path | None:
    """A component's single file: `value` itself when it is a path to a file, else `value` looked up in the
    ComfyUI models folder `models_dir` (diffusion_models/, vae/, text_encoders/). None when `value` is empty."""
    if component not in MODEL_FOLDERS:
        raise ValueError(f"unknown component {component!r}; accepted: {', '.join(MODEL_FOLDERS)}")
    if not value:
        return None
    path = Path(value).expanduser()
    if path.is_file() or not models_dir:
        return path  # a missing file is reported by its loader, naming the path
    folder = Path(models_dir).expanduser()
    if not folder.is_dir():
        raise ModelNotFoundError(f"ComfyUI models folder {str(folder)!r} (model.comfyui_models_dir) does not exist")
    candidate = folder / MODEL_FOLDERS[component] / value
    if candidate.is_file():
        return candidate
    raise ModelNotFoundError(f"{component} file {str(value)!r} is neither a file nor in {str(candidate.parent)!r}; "
                             f"give a path or a file name of the models folder's {MODEL_FOLDERS[component]}/")


def comfyui_dir_near(models_dir: str | Path | None) -> Path | None:
    """The ComfyUI installation a models folder belongs to (its parent, when that holds ComfyUI's bundled Qwen2.5
    tokenizer, comfy/text_encoders/qwen25_tokenizer/), else None."""
    if not models_dir:
        return None
    root = Path(models_dir).expanduser().resolve().parent
    return root if (root / DEFAULT.stage("text_encoder_file").COMFY_TOKENIZER_DIR).is_dir() else None


def load_scheduler_config(model_dir: Path) -> dict:
    """The FlowMatchEulerDiscreteScheduler config; the sampler makes a fresh scheduler from it per call."""
    path = model_dir / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{str(path)!r} is missing: the model directory has no scheduler config")
    return json.loads(path.read_text())


def shipped_sigmas(model_dir: Path) -> list[float] | None:
    """The sigma list a few-step checkpoint ships as its default schedule (`sample_sigmas` in model_index.json,
    which diffusers' pipelines read the same way), or None."""
    index = Path(model_dir) / "model_index.json"
    value = json.loads(index.read_text()).get("sample_sigmas") if index.is_file() else None
    return [float(s) for s in value] if value else None


def replicate(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """An independent copy of `module` on `device` (the uncond transformer of split CFG)."""
    with torch.inference_mode(False):
        return copy.deepcopy(module).to(device)


@dataclass
class Components:
    """Loaded components. Any may be None when a stage does not need it (training from the cache loads
    only the transformer)."""

    model_dir: Path
    variant: str
    scheduler_config: dict
    transformer: torch.nn.Module | None = None
    vae: torch.nn.Module | None = None
    text_encoder: TextEncoder | None = None
    #: single files the transformer / VAE came from (None: the model directory)
    transformer_file: Path | None = None
    vae_file: Path | None = None
    #: single file the text encoder came from, and the ComfyUI installation whose bundled tokenizer it uses
    text_encoder_file: Path | None = None
    comfyui_dir: Path | None = None

    def require(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise RuntimeError(f"component(s) {', '.join(missing)} not loaded; load them first "
                               "(QwenImageEditTrainer.load_model or the loader nodes)")


def load_components(name_or_path: str | Path, plan, *, which=("transformer", "vae", "text_encoder"),
                    quantize_transformer: str = "none", quantize_text_encoder: str = "none",
                    transformer_file: str | Path | None = None, vae_file: str | Path | None = None,
                    text_encoder_file: str | Path | None = None, comfyui_dir: str | Path | None = None,
                    transformer_fp8: str = "auto", transformer_plan=None) -> Components:
    """Load the named components on the plan's devices (the plan is already validated).

    `transformer_file` / `vae_file` / `text_encoder_file`: single files (ComfyUI's layouts) in place of the
    directory's subfolders; `comfyui_dir`: a ComfyUI installation whose bundled tokenizer serves the text
    encoder when the directory has no processor/; `transformer_fp8`: keep a scaled-fp8 transformer file's
    weights in fp8 or upcast them (single_file.FP8_MODES); `transformer_plan`: a `speed.WeightPlan` made before
    loading (its device and dtype are the transformer's, in place of `plan`'s): the transformer is streamed
    straight into that form (model/planned_load.py) instead of being loaded whole on its device."""
    model_dir = resolve_model_dir(name_or_path)
    unknown = set(which) - {"transformer", "vae", "text_encoder"}
    if unknown:
        raise ValueError(f"unknown component(s) {sorted(unknown)}; accepted: transformer, vae, text_encoder")
    from qwen_edit_core.model.weight_files import check_model_files
    check_model_files(model_dir, which, {"transformer": transformer_file, "vae": vae_file,
                                         "text_encoder": text_encoder_file})  # headers only, before any weight
    comps = Components(model_dir=model_dir, variant=detect_variant(model_dir),
                       scheduler_config=load_scheduler_config(model_dir),
                       transformer_file=Path(transformer_file) if transformer_file else None,
                       vae_file=Path(vae_file) if vae_file else None,
                       text_encoder_file=Path(text_encoder_file) if text_encoder_file else None,
                       comfyui_dir=Path(comfyui_dir) if comfyui_dir else None)
    family = variants.get(comps.variant).family
    from qwen_edit_core.model.family_files import check_file_family
    check_file_family({"transformer": transformer_file, "vae": vae_file, "text_encoder": text_encoder_file}, family,
                      comps.variant)  # headers only
    log.info("%s: licence %s", family.title, family.licence)
    if (sigmas := shipped_sigmas(model_dir)) is not None:
        log.info("a few-step checkpoint: it ships its own schedule of %d sigmas (model_index.json sample_sigmas), "
                 "which sampling uses unless sigmas are given", len(sigmas))
    if "text_encoder" in which:
        comps.text_encoder = load_text_encoder(model_dir, device=plan.text_encoder, dtype=plan.dtype,
                                               quantize=quantize_text_encoder, text_encoder_file=text_encoder_file,
                                               comfyui_dir=comfyui_dir, family=family)
    if "vae" in which:
        comps.vae = load_vae(model_dir, device=plan.vae, dtype=plan.dtype, family=family, vae_file=vae_file)
    if "transformer" in which and transformer_plan is not None and quantize_transformer == "none":
        from qwen_edit_core.model.planned_load import load_transformer_planned
        from qwen_edit_core.model.weight_source import weight_source
        comps.transformer = load_transformer_planned(weight_source(model_dir, transformer_file, transformer_fp8),
                                                     transformer_plan)
    elif "transformer" in which and transformer_file:
        from qwen_edit_core.model.planned_load import load_transformer_file
        comps.transformer = load_transformer_file(transformer_file, device=plan.transformer, dtype=plan.dtype,
                                                  fp8=transformer_fp8)
    elif "transformer" in which:
        comps.transformer = load_transformer(model_dir, device=plan.transformer, dtype=plan.dtype,
                                             quantize=quantize_transformer, family=family)
    if which:
        log.info("loaded %s from %s (%s) on %s", ", ".join(which), model_dir, comps.variant, plan.as_dict())
    return comps
