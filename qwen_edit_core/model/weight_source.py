"""Where the transformer's weights come from, one module at a time, for the planned loader (model/planned_load.py).

A source gives the architecture (a diffusers config) and every tensor's shape before any weight is read, then
the host tensors of one module at a time (a weight with its scales and bias), and converts them into that
module's state-dict entries in the compute dtype (a ComfyUI scaled-fp8 file's block linears stay in fp8 where
`keeps_fp8` says so). Every source names its model family (families/family.py), whose transformer class the
loader builds and whose file layout (`Family.layout`) maps a single file's keys onto that class's: one code path
for the 2025 family and Qwen-Image-2.1 (whose ComfyUI files fuse the MLP's gate and up projections). Three
sources:
- `DirectorySource`: a diffusers directory's `transformer/` (`config.json` and `diffusion_pytorch_model.safetensors`,
  or the pieces a sharded checkpoint's `diffusion_pytorch_model.safetensors.index.json` names in its
  `weight_map`; diffusers' own layout, `diffusers.utils.constants` SAFE_WEIGHTS_NAME / SAFE_WEIGHTS_INDEX_NAME);
- `SingleFileSource`: one ComfyUI file (model/single_file.py: prefixes, markers, scaled fp8, the architecture
  read from the shapes);
- `ShapeOnlySource`: a config and no file: every tensor is an uninitialised host tensor of the right shape and
  dtype. It lets the loader's own code run where no weights exist (a memory simulation at real size under
  torch's FakeTensorMode, or a count of the bytes placed on each device).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from qwen_edit_core.model import file_stream, single_file
from qwen_edit_core.families import DEFAULT, Family, family_of

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"


def _by_module(keys) -> dict[str, list[str]]:
    """Keys grouped by the module they belong to ("a.b.weight" -> "a.b"), in first-seen order."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.rpartition(".")[0], []).append(key)
    return groups


def cast_floats(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to `dtype` (what diffusers' `from_pretrained(torch_dtype=...)` does), others as read."""
    return {k: v.to(dtype) if v.dtype.is_floating_point else v for k, v in tensors.items()}


class DirectorySource:
    """The transformer of a diffusers-layout model directory (one safetensors file or a sharded checkpoint)."""

    def __init__(self, model_dir: Path):
        from qwen_edit_core.model.weight_files import ModelNotFoundError, require_safetensors
        folder = Path(model_dir) / "transformer"
        self.name = str(folder)
        require_safetensors(folder, "transformer")
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(f"{str(folder)!r} has no config.json: expected a diffusers transformer folder")
        self._config = json.loads((folder / "config.json").read_text())
        self.family = family_of(self._config)
        if (folder / INDEX_NAME).is_file():
            weight_map = json.loads((folder / INDEX_NAME).read_text()).get("weight_map", {})
            where = {key: folder / name for key, name in weight_map.items()}
        elif (folder / WEIGHTS_NAME).is_file():
            where = {key: folder / WEIGHTS_NAME for key in file_stream.read_entries(folder / WEIGHTS_NAME)[0]}
        else:
            raise ModelNotFoundError(f"{str(folder)!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
        self.reader = file_stream.TensorReader(where)

    def config(self) -> dict:
        """The diffusers config of the transformer (config.json as saved)."""
        return dict(self._config)

    def header(self) -> dict[str, torch.Tensor]:
        return self.reader.meta()

    def keeps_fp8(self, device: torch.device) -> bool:
        return False

    def modules(self) -> Iterator[dict[str, torch.Tensor]]:
        with self.reader:
            for keys in _by_module(self.reader.where).values():
                yield self.reader.read(keys)

    def convert(self, tensors: dict[str, torch.Tensor], fp8_modules: set[str], dtype: torch.dtype,
                keep: bool) -> dict[str, torch.Tensor]:
        return cast_floats(tensors, dtype)


class SingleFileSource:
    """A transformer of either family as one ComfyUI safetensors file (the family read from its keys, its layout
    from the family); `fp8`: single_file.FP8_MODES."""

    def __init__(self, path: Path, fp8: str = "auto"):
        self.name, self.path, self.fp8 = str(path), Path(path), fp8
        self._raw, self._names, flags = single_file._read_header(self.path)
        self.family = family_of(self._raw)
        self._layout = self.family.layout()
        self._config = self._layout.detect_config(self._raw, flags, source=self.name)

    def config(self) -> dict:
        return dict(self._config)

    def header(self) -> dict[str, torch.Tensor]:
        """The file's tensors (meta) under the model's keys (its layout's `to_model`: a fused MLP split, scales with
        their halves), not yet converted (scales and fp8 as stored)."""
        return self._layout.to_model(dict(self._raw))

    def stored(self) -> dict[str, torch.Tensor]:
        """The file's tensors (meta) as stored, under diffusers' names (prefixes and markers dropped)."""
        return dict(self._raw)

    def keeps_fp8(self, device: torch.device) -> bool:
        """Whether the file's e4m3 block weights stay in fp8 on `device` (single_file.keeps_fp8)."""
        return single_file.keeps_fp8(self.fp8, self._raw, device)

    def modules(self) -> Iterator[dict[str, torch.Tensor]]:
        reader = file_stream.TensorReader({k: self.path for k in self._names})
        with reader:
            for file_keys in file_stream.module_groups(self._names).values():
                # the layout may turn one stored module into several (2.1's fused MLP): each is yielded on its
                # own (views of the stored tensor), so only one of them is converted on the device at a time
                tensors = self._layout.to_model({self._names[k]: v for k, v in reader.read(file_keys).items()})
                for keys in _by_module(tensors).values():
                    yield {k: tensors[k] for k in keys}

    def convert(self, tensors: dict[str, torch.Tensor], fp8_modules: set[str], dtype: torch.dtype,
                keep: bool) -> dict[str, torch.Tensor]:
        """Kept fp8 weights as `Fp8Linear` entries, the rest upcast with their scales (single_file); `tensors`
        are under the model's keys (`modules`, `header`)."""
        if keep:
            return single_file._fp8_state(tensors, fp8_modules, dtype)
        return single_file.dequantize(tensors, dtype)


class ShapeOnlySource:
    """No file: a transformer `config` of `family` whose tensors are uninitialised host tensors in `dtype` (see
    module doc)."""

    def __init__(self, config: dict, dtype: torch.dtype = torch.bfloat16, family: Family = DEFAULT):
        from accelerate import init_empty_weights
        self.name, self._config, self.family = "shapes only (no weights)", dict(config), family
        with init_empty_weights():
            model = family.class_of("transformer").from_config(self._config)
        self._meta = {k: torch.empty(v.shape, dtype=dtype, device="meta") for k, v in model.state_dict().items()}

    def config(self) -> dict:
        return dict(self._config)

    def header(self) -> dict[str, torch.Tensor]:
        return dict(self._meta)

    def keeps_fp8(self, device: torch.device) -> bool:
        return False

    def modules(self) -> Iterator[dict[str, torch.Tensor]]:
        for keys in _by_module(self._meta).values():
            yield {k: torch.empty(self._meta[k].shape, dtype=self._meta[k].dtype) for k in keys}

    def convert(self, tensors: dict[str, torch.Tensor], fp8_modules: set[str], dtype: torch.dtype,
                keep: bool) -> dict[str, torch.Tensor]:
        return cast_floats(tensors, dtype)


def weight_source(model_dir: Path | None, transformer_file: str | Path | None = None, fp8: str = "auto"):
    """The source of the transformer's weights: the single file when given, else the directory's transformer/."""
    if transformer_file:
        return SingleFileSource(Path(transformer_file), fp8)
    return DirectorySource(Path(model_dir))
