"""Headless core of the Qwen-Image-Edit LoRA node pack: load, encode, cache, train, sample.

Never imports ComfyUI. `from qwen_edit_core import QwenImageEditTrainer, load_config` is the scripting API.
"""

from qwen_edit_core.config import Config, load_config

__all__ = ["Config", "QwenImageEditTrainer", "load_config"]


def __getattr__(name: str):
    """`QwenImageEditTrainer` is imported on first use: it pulls in torch and diffusers (seconds), which the
    `qwen-edit` command's start (`--help`, argument and config errors) and reading a config do not need."""
    if name == "QwenImageEditTrainer":
        from qwen_edit_core.api import QwenImageEditTrainer
        return QwenImageEditTrainer
    raise AttributeError(f"module 'qwen_edit_core' has no attribute {name!r}")
