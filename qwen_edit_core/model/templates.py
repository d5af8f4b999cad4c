"""Prompt templates of the Qwen-Image pipelines and the number of template tokens dropped after encoding.

The strings are the pipelines' own (diffusers `pipeline_qwenimage*.py`); the text encoder's hidden states
for the first ``*_DROP`` tokens (system prompt and chat framing) are discarded, so a tokenizer that splits
the prefix differently would leak template text into the embeddings. `tiny.build_tiny` trains its
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
#: Qwen-Image-Edit-2509/2511 ("Edit Plus"): the user turn is "Picture 1: <img>Picture 2: <img>...{prompt}".
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

#: The text encoder's position limit used by the pipelines (tokens after the template prefix is dropped).
MAX_SEQUENCE_LENGTH = 1024

VARIANTS = ("edit", "edit-plus")


def format_edit_prompt(prompt: str, num_images: int, variant: str) -> tuple[str, int]:
    """Return (text for the processor, number of leading tokens to drop) for one prompt.

    ``variant="edit"`` takes exactly one image; ``"edit-plus"`` takes 0..N images, each announced as
    "Picture i:" in the user turn.
    """
    if variant == "edit":
        if num_images != 1:
            raise ValueError(f"variant 'edit' takes exactly one control image, got {num_images}; "
                             "use variant 'edit-plus' for several")
        return EDIT_TEMPLATE.format(prompt), EDIT_DROP
    if variant == "edit-plus":
        images = "".join(EDIT_PLUS_IMAGE_PREFIX.format(i + 1) for i in range(num_images))
        return EDIT_PLUS_TEMPLATE.format(images + prompt), EDIT_PLUS_DROP
    raise ValueError(f"unknown variant {variant!r}; accepted: {', '.join(VARIANTS)}")
