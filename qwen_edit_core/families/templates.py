"""Prompt templates of the Qwen-Image pipelines and the number of template tokens dropped after encoding.

The strings are the pipelines' own (diffusers `pipeline_qwenimage*.py`); the text encoder's hidden states
for the first ``*_DROP`` tokens (system prompt and chat framing) are discarded, so a tokenizer that splits
the prefix differently would leak template text into the embeddings. `families/variants.py` says which
variant uses which template. `tiny.build_tiny` trains its
tokenizer so these counts hold and asserts it.
"""

from __future__ import annotations

_EDIT_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)

#: Qwen-Image-Edit: one control image, its vision tokens right before the instruction.
EDIT_TEMPLATE = _EDIT_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
#: Qwen-Image-Edit-2509/2511 (Edit Plus): the user turn is "Picture 1: <img>Picture 2: <img>...{prompt}".
EDIT_PLUS_TEMPLATE = _EDIT_SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PLUS_IMAGE_PREFIX = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
#: Qwen-Image text-to-image.
T2I_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)

EDIT_DROP = 64
EDIT_PLUS_DROP = 64
T2I_DROP = 34

#: The longest prompt, in tokens of the prompt's own text: diffusers' text-to-image pipeline truncates its prompt
#: there (`tokenizer_max_length = 1024`) and the edit pipelines refuse a larger `max_sequence_length`. The control
#: images' vision tokens come on top (1,369 for one control at 1 MP) and are not limited by it.
MAX_SEQUENCE_LENGTH = 1024

#: The one "empty" prompt: caption dropout's empty caption, the default negative prompt of sampling and
#: `predict`. A single space, as the model card's examples pass it (diffusers' pipelines turn true CFG off for
#: `negative_prompt=None`); training drops captions to the same embeddings inference uses as its negative.
EMPTY_PROMPT = " "

#: Qwen-Image-2.1 (diffusers `QwenImage21Pipeline`): one template for text-to-image and editing; the user turn is
#: "<image1><img> <image2><img> ...{prompt}" (no reference: just the prompt). Only the system turn is dropped, and
#: its token count is the processor's (`QwenImage21Pipeline._drop_idx`: the tokenized system message), so it is
#: not a constant here.
QWEN21_SYSTEM = "Comprehend and analyze the provided prompt."
QWEN21_TEMPLATE = (f"<|im_start|>system\n{QWEN21_SYSTEM}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
                   "<|im_start|>assistant\n")
QWEN21_IMAGE_PREFIX = "<image{}><|vision_start|><|image_pad|><|vision_end|>"
QWEN21_IMAGE_SEPARATOR = " "
