"""Headless core of the Qwen-Image-Edit LoRA node pack: load, encode, cache, train, sample.

Never imports ComfyUI. `from qwen_edit_core import QwenImageEditTrainer, doctor_dataset, load_config` is the
scripting API.
"""

from qwen_edit_core.config import Config, load_config

__all__ = ["Config", "QwenImageEditTrainer", "doctor_dataset", "load_config"]


def __getattr__(name: str):
    """`QwenImageEditTrainer` and `doctor_dataset` are imported on first use: they pull in torch and diffusers
    (seconds), which the `qwen-edit` command's start (`--help`, argument and config errors) and reading a config do
    not need."""
    if name == "QwenImageEditTrainer":
        from qwen_edit_core.api import QwenImageEditTrainer
        return QwenImageEditTrainer
    if name == "doctor_dataset":
        from qwen_edit_core.api import doctor_dataset
        return doctor_dataset
    raise AttributeError(f"module 'qwen_edit_core' has no attribute {name!r}")
