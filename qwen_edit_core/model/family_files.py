"""Single files (ComfyUI's layouts) given with a model directory: which model family each file is, refusing one of
the other family than the directory's (the scheduler, processor and encoders come from the directory), and the
VAE file loaded as its family's model.

A file's family is read from its header alone (`families.family_of`).
Qwen-Image-2.1's text encoder is not read from a single file: ComfyUI ships it only as int8 "convrot"
(`qwen3vl_8b_int8_convrot`), a format this project does not read, so a 2.1 model takes its directory's
text_encoder/.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qwen_edit_core.model import file_stream, single_file
from qwen_edit_core.model.weight_files import ModelNotFoundError
from qwen_edit_core.families import Family, family_of


def check_file_family(files: dict[str, str | Path | None], family: Family, variant: str) -> None:
    """Refuse a transformer or VAE file of the other family than the directory's, naming both, and any text
    encoder file for Qwen-Image-2.1 (`check_text_encoder_file`). Missing files are left to their loaders."""
    for kind, path in files.items():
        if not path or not Path(path).is_file():
            continue
        if kind == "text_encoder":
            check_text_encoder_file(path, family)
            continue
        found = family_of(file_stream.read_header(Path(path)))
        if found is not family:
            raise ModelNotFoundError(f"{kind} file {str(path)!r} is a {found.file_title} {kind}, but the model "
                                     f"directory is {family.title} ({variant}); give a model directory of the "
                                     "file's family (its scheduler, processor and encoders are read from the "
                                     "directory)")


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
    """Refuse a text encoder file for a family whose encoder is not read from one (its file layout's
    `TEXT_ENCODER_REFUSAL`), naming the file's quantization format when it has one (ComfyUI's int8 "convrot")."""
    refusal = family.layout().TEXT_ENCODER_REFUSAL
    if not refusal:
        return
    formats = _quant_formats(Path(path)) if Path(path).is_file() else []
    found = f"a file quantized as {', '.join(repr(f) for f in formats)}" if formats else "a single file"
    raise single_file.SingleFileError(f"text encoder file {str(path)!r}: {refusal.format(found=found)}")


def vae_statistics(model_dir: Path | None) -> dict | None:
    """The model directory's vae/config.json (its latent statistics serve a VAE file that has none), or None."""
    config = Path(model_dir) / "vae" / "config.json" if model_dir is not None else None
    return json.loads(config.read_text()) if config is not None and config.is_file() else None


def load_vae_file(path: str | Path, model_dir: Path | None, family: Family, *, device: torch.device,
                  dtype: torch.dtype):
    """A VAE file as its family's model (`single_file.load_vae_file`), with what its family reads from the
    directory (`directory_config` of families/<family>/vae_file.py: Qwen-Image-2.1's latent statistics, which
    ComfyUI's file lacks)."""
    config = family.stage("vae_file").directory_config(vae_statistics(model_dir))
    return single_file.load_vae_file(path, device=device, dtype=dtype, config=config)
