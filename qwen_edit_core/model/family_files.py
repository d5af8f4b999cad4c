"""Single files (ComfyUI's layouts) given with a model directory: which model family each file is, refusing one of
the other family than the directory's (the scheduler, processor and encoders come from the directory), and the
VAE file loaded as its family's model.

A file's family is read from its header alone (`single_file21.is_21`, `vae_file21.is_21`). Qwen-Image-2.1's text
encoder is not read from a single file: ComfyUI ships it only as int8 "convrot" (`qwen3vl_8b_int8_convrot`), a
format this project does not read, so a 2.1 model takes its directory's text_encoder/.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qwen_edit_core.model import file_stream, single_file
from qwen_edit_core.families.qwen_image_21 import single_file as single_file21
from qwen_edit_core.families.qwen_image_21 import vae_file as vae_file21
from qwen_edit_core.model.weight_files import ModelNotFoundError
from qwen_edit_core.families import Family

#: what `is_21` reads in each kind of file
_DETECT = {"transformer": single_file21.is_21, "vae": vae_file21.is_21}
_OLD = "Qwen-Image-Edit (2025)"


def _is_21_family(family: Family) -> bool:
    return family.name == single_file21.FAMILY


def check_file_family(files: dict[str, str | Path | None], family: Family, variant: str) -> None:
    """Refuse a transformer or VAE file of the other family than the directory's, naming both, and any text
    encoder file for Qwen-Image-2.1 (`check_text_encoder_file`). Missing files are left to their loaders."""
    for kind, path in files.items():
        if not path or not Path(path).is_file():
            continue
        if kind == "text_encoder":
            check_text_encoder_file(path, family)
            continue
        file_21 = _DETECT[kind](file_stream.read_header(Path(path)))
        if file_21 != _is_21_family(family):
            what = "Qwen-Image-2.1" if file_21 else _OLD
            raise ModelNotFoundError(f"{kind} file {str(path)!r} is a {what} {kind}, but the model directory is "
                                     f"{family.title} ({variant}); give a model directory of the file's family (its "
                                     "scheduler, processor and encoders are read from the directory)")


def _quant_formats(path: Path) -> list[str]:
    """The formats named by a file's `.comfy_quant` notes (only those small tensors are read)."""
    header = file_stream.read_header(path)
    notes = file_stream.read_tensors(path, [k for k in header if k.endswith(".comfy_quant")])
    formats = set()
    for value in notes.values():
        try:
            formats.add(str(json.loads(bytes(value.to(torch.uint8).tolist())).get("format", "")))
        except (ValueError, AttributeError):
            formats.add("unreadable")
    return sorted(formats)


def check_text_encoder_file(path: str | Path, family: Family) -> None:
    """Refuse a text encoder file for Qwen-Image-2.1, naming its quantization format when it has one (ComfyUI's
    int8 "convrot") and what to use instead."""
    if not _is_21_family(family):
        return
    formats = _quant_formats(Path(path)) if Path(path).is_file() else []
    found = f"a file quantized as {', '.join(repr(f) for f in formats)}" if formats else "a single file"
    raise single_file.SingleFileError(
        f"text encoder file {str(path)!r}: Qwen-Image-2.1's text encoder (Qwen3-VL) is not read from {found}. "
        "ComfyUI ships it only as int8 'convrot' (qwen3vl_8b_int8_convrot.safetensors), which this project does not "
        "read: leave the text encoder file empty, and the 2.1 model directory's text_encoder/ "
        "(Qwen3VLForConditionalGeneration) is loaded")


def vae_statistics(model_dir: Path | None) -> dict | None:
    """The model directory's vae/config.json (its latent statistics serve a VAE file that has none), or None."""
    config = Path(model_dir) / "vae" / "config.json" if model_dir is not None else None
    return json.loads(config.read_text()) if config is not None and config.is_file() else None


def load_vae_file(path: str | Path, model_dir: Path | None, family: Family, *, device: torch.device,
                  dtype: torch.dtype):
    """A VAE file as its family's model (`single_file.load_vae_file`); a Qwen-Image-2.1 one takes the directory's
    latent statistics (ComfyUI's file has none)."""
    statistics = vae_statistics(model_dir) if _is_21_family(family) else None
    return single_file.load_vae_file(path, device=device, dtype=dtype, config=statistics)
