"""Headless core of the Qwen-Image-Edit LoRA node pack: load, encode, cache, train, sample.

Never imports ComfyUI. `from qwen_edit_core import QwenImageEditTrainer, load_config` is the scripting API.
"""

from qwen_edit_core.config import Config, load_config
from qwen_edit_core.api import QwenImageEditTrainer

__all__ = ["Config", "QwenImageEditTrainer", "load_config"]
