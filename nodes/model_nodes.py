"""Loader nodes (whole model or one component each, on the device the user picks) and the LoRA loader."""

from __future__ import annotations

from pathlib import Path

import torch

from qwen_edit_core.model import components as comp
from qwen_edit_core.adapters import lora
from qwen_edit_core.model.devices import resolve_device, resolve_dtype

from . import comfy_runtime
from .loaded_models import TracksLoads, hidden_id
from .common import (CATEGORY, DTYPES, MODEL, SCHEDULER, TEXT_ENCODER, TIPS, TRANSFORMER, VAE, ModelHandle,
                     device_choices, model_choices, resolve_model)


FROM_DIRECTORY = "(from the model directory)"


def _model_inputs(extra: dict | None = None, transformer_file: bool = False, vae_file: bool = False,
                  text_encoder_file: bool = False) -> dict:
    optional = {"path": ("STRING", {"default": "", "tooltip": "a diffusers-layout directory; overrides the list"})}
    if transformer_file:
        files = comfy_runtime.folder_files("diffusion_models", ".safetensors")
        optional["transformer_file"] = ([FROM_DIRECTORY] + files,
                                        {"tooltip": "a Qwen-Image transformer file of ComfyUI's diffusion_models "
                                                    "folder (bf16 or scaled fp8) instead of the directory's"})
    if vae_file:
        optional["vae_file"] = ([FROM_DIRECTORY] + comfy_runtime.folder_files("vae", ".safetensors"),
                                {"tooltip": "a Qwen-Image VAE file of ComfyUI's vae folder (qwen_image_vae)"})
    if text_encoder_file:  # added last: saved workflows keep widget values by position
        files = comfy_runtime.folder_files("text_encoders", ".safetensors")
        optional["text_encoder_file"] = ([FROM_DIRECTORY] + files,
                                         {"tooltip": "a Qwen2.5-VL text encoder file of ComfyUI's text_encoders "
                                                     "folder (qwen_2.5_vl_7b, bf16 or scaled fp8); its tokenizer "
                                                     "is the directory's processor/, else ComfyUI's own"})
    model = (model_choices(), {"tooltip": "a diffusers-layout Qwen-Image-Edit (or Edit Plus) directory of "
                                          "models/qwen_edit/, or a built-in model for trying workflows: the "
                                          "pretrained toy ones (Qwen-Image-Edit, Qwen-Image-2.1: they edit 128 px "
                                          "pictures of shapes) or the tiny random ones (their images are noise)"})
    return {"required": {"model": model, **(extra or {})}, "optional": optional}


def _device(component: str) -> tuple:
    return (device_choices(), {"tooltip": f"{component}: {TIPS['device']}"})


DTYPE = (DTYPES, {"tooltip": TIPS["dtype"]})
#: the last input of the loaders that load a transformer: ComfyUI hands every loader with equal inputs the same
#: cached model object, so a second copy of the weights needs an input that differs
INSTANCE = ("INT", {"default": 0, "min": 0, "max": 99,
                    "tooltip": "0: the usual. Another number loads a separate copy of the weights (ComfyUI gives "
                               "loaders with identical settings the same model), e.g. to sample with one copy while "
                               "a training job trains on the other; each copy takes the model's full memory"})


def _with_instance(inputs: dict) -> dict:
    inputs["optional"]["instance"] = INSTANCE  # added last: saved workflows keep widget values by position
    return inputs
QUANTIZE = (list(comp.QUANTIZE_MODES), {"tooltip": TIPS["quantize"]})
FP8_LOAD = ("BOOLEAN", {"default": False, "tooltip": (
    "read the transformer's block linears straight into fp8 (e4m3) as they load: the bf16 transformer never "
    "sits whole on the device, which then holds about half of it (GPUs with fp8 matmuls: Ada/Hopper; refused "
    "elsewhere). Sampling and training use the fp8 weights; LoRAs stay bf16. A scaled-fp8 file stays fp8 anyway")})


def _with_fp8(inputs: dict) -> dict:
    inputs["optional"]["transformer_fp8"] = FP8_LOAD  # added after `instance`: saved workflows keep their values
    return inputs


def _fp8_plan(fp8: bool, device: torch.device, dtype: torch.dtype):
    """The planned loader's plan for `transformer_fp8` (block linears streamed into fp8 on `device`), or None
    (loaded as stored)."""
    if not fp8:
        return None
    from qwen_edit_core import speed
    return speed.checked_plan(device, dtype, 0, fp8=True, n_checkpointed=None, n_offloaded=0)


def _transformer_file(name: str | None) -> Path | None:
    return None if not name or name == FROM_DIRECTORY else comfy_runtime.folder_file_path("diffusion_models", name)


def _vae_file(name: str | None) -> Path | None:
    return None if not name or name == FROM_DIRECTORY else comfy_runtime.folder_file_path("vae", name)


def _text_encoder_file(name: str | None) -> Path | None:
    return None if not name or name == FROM_DIRECTORY else comfy_runtime.folder_file_path("text_encoders", name)


def _resolve(name: str, component: str) -> torch.device:
    return resolve_device(name, component=component)


class QwenEditModelLoader(TracksLoads):
    """Transformer, VAE and text encoder of one diffusers-layout directory, each on its own device."""

    CATEGORY = f"{CATEGORY}/loaders"
    SEARCH_ALIASES = ["load qwen image edit", "qwen edit checkpoint", "load diffusers model", "load model"]
    DESCRIPTION = ("Loads a Qwen-Image-Edit model (transformer, VAE, text encoder) from a diffusers-layout "
                   "folder of models/qwen_edit/ or ComfyUI's own single files, each component on the device "
                   "you pick. Start every Qwen Edit graph here; the built-in tiny model tries workflows "
                   "without downloads.")
    RETURN_TYPES = (MODEL,)
    RETURN_NAMES = ("model",)

    @classmethod
    def INPUT_TYPES(cls):
        return hidden_id(_with_fp8(_with_instance(_model_inputs({
            "transformer_device": _device("transformer (20 B parameters: ~38 GiB in bf16)"),
            "vae_device": _device("VAE (~0.25 GB)"),
            "text_encoder_device": _device("text encoder (Qwen2.5-VL 7B: ~16 GB in bf16)"),
            "dtype": DTYPE}, transformer_file=True, vae_file=True, text_encoder_file=True))))

    def load(self, model, transformer_device, vae_device, text_encoder_device, dtype, path="",
             transformer_file=None, vae_file=None, text_encoder_file=None, instance=0, transformer_fp8=False):
        from qwen_edit_core.model.devices import DevicePlan
        plan = DevicePlan.from_mapping({"transformer": transformer_device, "vae": vae_device,
                                        "text_encoder": text_encoder_device}, dtype=dtype)
        return (ModelHandle(comp.load_components(resolve_model(model, path), plan,
                                                 transformer_file=_transformer_file(transformer_file),
                                                 vae_file=_vae_file(vae_file),
                                                 text_encoder_file=_text_encoder_file(text_encoder_file),
                                                 comfyui_dir=comfy_runtime.comfyui_dir(),
                                                 transformer_plan=_fp8_plan(transformer_fp8, plan.transformer,
                                                                            plan.dtype))),)


class QwenEditTransformerLoader(TracksLoads):
    CATEGORY = f"{CATEGORY}/loaders"
    SEARCH_ALIASES = ["load transformer", "load unet", "load diffusion model", "qwen edit dit"]
    DESCRIPTION = ("Loads only the transformer (the 20 B parameter denoiser) on one device, optionally "
                   "int8/nf4 or from a diffusion_models file. Combine with the other component loaders in "
                   "Assemble Model.")
    RETURN_TYPES = (TRANSFORMER,)
    RETURN_NAMES = ("transformer",)

    @classmethod
    def INPUT_TYPES(cls):
        return hidden_id(_with_fp8(_with_instance(_model_inputs({"device": _device("transformer"), "dtype": DTYPE,
                                                                "quantize": QUANTIZE}, transformer_file=True))))

    def load(self, model, device, dtype, quantize, path="", transformer_file=None, instance=0,
             transformer_fp8=False):
        directory = comp.resolve_model_dir(resolve_model(model, path))
        file = _transformer_file(transformer_file)
        plan = _fp8_plan(transformer_fp8, _resolve(device, "transformer"), resolve_dtype(dtype))
        if file is not None:
            from qwen_edit_core.model.family_files import check_file_family
            check_file_family({"transformer": file}, comp.family_of(directory), comp.detect_variant(directory))
        if plan is not None:
            if quantize != "none":
                raise ValueError(f"transformer_fp8 and quantize {quantize!r} are two forms of the same weights: "
                                 "pick one (set quantize to none, or transformer_fp8 off)")
            from qwen_edit_core.model.planned_load import load_transformer_planned
            from qwen_edit_core.model.weight_source import weight_source
            module = load_transformer_planned(weight_source(directory, file, "auto"), plan)
        elif file is not None:
            from qwen_edit_core.model.planned_load import load_transformer_file
            module = load_transformer_file(file, device=_resolve(device, "transformer"), dtype=resolve_dtype(dtype))
        else:
            module = comp.load_transformer(directory, device=_resolve(device, "transformer"),
                                           dtype=resolve_dtype(dtype), quantize=quantize)
        return ((directory, module, file),)  # the file travels on: cache identity, training config


class QwenEditVAELoader(TracksLoads):
    CATEGORY = f"{CATEGORY}/loaders"
    SEARCH_ALIASES = ["load vae", "qwen image vae"]
    DESCRIPTION = ("Loads only the Qwen-Image VAE on one device (from the model folder or a file of "
                   "ComfyUI's vae folder, read as the model folder's family: Qwen-Image or Qwen-Image-2.1).")
    RETURN_TYPES = (VAE,)
    RETURN_NAMES = ("vae",)

    @classmethod
    def INPUT_TYPES(cls):
        return hidden_id(_model_inputs({"device": _device("VAE"), "dtype": DTYPE}, vae_file=True))

    def load(self, model, device, dtype, path="", vae_file=None):
        file = _vae_file(vae_file)  # the model's family (from its directory) decides how the file is read
        directory = comp.resolve_model_dir(resolve_model(model, path))
        return ((comp.load_vae(directory, device=_resolve(device, "vae"), dtype=resolve_dtype(dtype), vae_file=file),
                 file),)


class QwenEditTextEncoderLoader(TracksLoads):
    """Qwen2.5-VL with its tokenizer and processor (weights from the directory or a text_encoders file)."""

    CATEGORY = f"{CATEGORY}/loaders"
    SEARCH_ALIASES = ["load text encoder", "load clip", "qwen2.5-vl", "qwen vl"]
    DESCRIPTION = ("Loads only the Qwen2.5-VL text encoder with its tokenizer on one device (from the model "
                   "folder or a text_encoders file).")
    RETURN_TYPES = (TEXT_ENCODER,)
    RETURN_NAMES = ("text_encoder",)

    @classmethod
    def INPUT_TYPES(cls):
        return hidden_id(_model_inputs({"device": _device("text encoder"), "dtype": DTYPE, "quantize": QUANTIZE},
                                       text_encoder_file=True))

    def load(self, model, device, dtype, quantize, path="", text_encoder_file=None):
        directory = comp.resolve_model_dir(resolve_model(model, path))
        return (comp.load_text_encoder(directory, device=_resolve(device, "text_encoder"), dtype=resolve_dtype(dtype),
                                       quantize=quantize, text_encoder_file=_text_encoder_file(text_encoder_file),
                                       comfyui_dir=comfy_runtime.comfyui_dir()),)


class QwenEditSchedulerLoader:
    CATEGORY = f"{CATEGORY}/loaders"
    SEARCH_ALIASES = ["load scheduler", "flow match scheduler"]
    DESCRIPTION = ("Reads the model folder's scheduler settings and whether it is Edit or Edit Plus; needed "
                   "by Assemble Model.")
    RETURN_TYPES = (SCHEDULER,)
    RETURN_NAMES = ("scheduler",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return _model_inputs()

    def load(self, model, path=""):
        directory = comp.resolve_model_dir(resolve_model(model, path))
        return ((directory, comp.detect_variant(directory), comp.load_scheduler_config(directory)),)


class QwenEditAssembleModel:
    """Components loaded separately (each on its own device) -> one model for the encode/sample/train nodes."""

    CATEGORY = f"{CATEGORY}/loaders"
    SEARCH_ALIASES = ["assemble model", "combine components", "join model"]
    DESCRIPTION = ("Joins separately loaded transformer, VAE, text encoder and scheduler into one model for "
                   "the encode, sample and train nodes.")
    RETURN_TYPES = (MODEL,)
    RETURN_NAMES = ("model",)
    FUNCTION = "assemble"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"transformer": (TRANSFORMER, {"tooltip": "from Load Transformer"}),
                             "vae": (VAE, {"tooltip": "the VAE from Load VAE"}),
                             "text_encoder": (TEXT_ENCODER, {"tooltip": "from Load Text Encoder"}),
                             "scheduler": (SCHEDULER, {"tooltip": "from Load Scheduler (also names the model "
                                                                  "directory and the Edit / Edit Plus variant)"})}}

    def assemble(self, transformer, vae, text_encoder, scheduler):
        directory, variant, config = scheduler
        _, transformer_module, transformer_file = transformer
        vae_module, vae_file = vae
        return (ModelHandle(comp.Components(model_dir=Path(directory), variant=variant, scheduler_config=config,
                                            transformer=transformer_module, vae=vae_module,
                                            text_encoder=text_encoder, transformer_file=transformer_file,
                                            vae_file=vae_file,
                                            text_encoder_file=text_encoder.weights_file,
                                            comfyui_dir=comfy_runtime.comfyui_dir())),)


class QwenEditLoraLoader:
    """Apply a LoRA file (ComfyUI, diffusers/peft or kohya layout) with a strength; chain for several."""

    CATEGORY = f"{CATEGORY}/lora"
    SEARCH_ALIASES = ["load lora", "apply lora", "lora loader", "lokr", "loha", "dora"]
    DESCRIPTION = ("Applies a LoRA file to the model with a strength (the model's weights stay unchanged; "
                   "chain several loaders for several LoRAs).")
    RETURN_TYPES = (MODEL,)
    RETURN_NAMES = ("model",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (MODEL, {"tooltip": TIPS["model"]}),
            "lora_name": (["(none)"] + comfy_runtime.folder_files("loras"),
                          {"tooltip": "a LoRA file of ComfyUI's models/loras folder (ComfyUI, diffusers/peft or "
                                      "kohya keys); (none): pass the model through"}),
            "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.05,
                                   "tooltip": "multiplies the LoRA's change: 1.0 as trained, 0.5-1.2 typical, 0 "
                                              "off, negative inverts the edit"})},
            "optional": {"lora_path": ("STRING", {"default": "", "forceInput": True,
                                                  "tooltip": "a LoRA file path (e.g. Training Status's lora_path); "
                                                             "used instead of lora_name when connected"})}}

    def apply(self, model, lora_name, strength, lora_path=None):
        if not lora_path and lora_name == "(none)":
            return (model,)
        path = Path(lora_path) if lora_path else comfy_runtime.folder_file_path("loras", lora_name)
        if not path.is_file():
            raise FileNotFoundError(f"LoRA file {str(path)!r} does not exist")
        # Fail here, at the loader, for a LoRA of another model (names and shapes are checked).
        lora.check_against(model.components.transformer, lora.read_lora_file(path))
        return (model.with_lora(str(path), strength),)
