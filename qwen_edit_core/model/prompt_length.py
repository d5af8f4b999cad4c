"""How long a training sample's prompt is, before any encoder loads: the text stream the transformer attends to.

The 2025 models put the control images' vision tokens into the text stream: the vision-language encoder sees
each control image (Edit: the VAE-sized image itself; Edit Plus and 2511: each control at `vl_area` for its
own aspect ratio, the pipelines' 384x384) and Qwen2.5-VL makes one token per 28x28 pixels (14 px patches
merged 2x2, sides rounded to multiples of 28: its processor's `smart_resize`). A 1024^2 Edit prompt therefore
holds 1,369 vision tokens, a 1536^2 one 3,025; an Edit Plus prompt 196 per control. Qwen-Image-2.1 replaces
each reference's vision slots by the reference's own latent tokens, which the image sequence already counts.

The memory planner (train.loop.setup, train.run.training_plan) and the real-size simulator (bench/fake_model.py)
both count tokens here, so the plan is made for the sequence the step really runs.
"""

from __future__ import annotations

from typing import Sequence

from qwen_edit_core.families import variants
from qwen_edit_core.model.geometry import calculate_dimensions

#: a long caption's own tokens plus the template's tail, beside the vision tokens (an assumption: captions of
#: 20-40 words; the template's prefix is dropped after encoding)
CAPTION_TOKENS = 40
#: Qwen2.5-VL's pixels per vision token along each side (14 px patches merged 2x2; sides rounded to 28)
VL_PATCH = 28
#: the pipelines' vision-language area per control image for Edit Plus and 2511 (384x384)
DEFAULT_VL_AREA = 384 * 384


def _vl_tokens(width: int, height: int) -> int:
    """Vision tokens of one image of `width` x `height` pixels as Qwen2.5-VL's processor sizes it."""
    return max(1, round(width / VL_PATCH)) * max(1, round(height / VL_PATCH))


def vision_tokens(variant: str, control_sizes: Sequence[tuple[int, int]], vl_area: int = DEFAULT_VL_AREA) -> int:
    """Vision tokens the control images (their VAE sizes (w, h)) add to the text stream of `variant`."""
    spec = variants.get(variant)
    if not spec.family.vision_in_text:
        return 0  # the reference's latent tokens replace its vision slots: image tokens, counted there
    if not spec.vl_own_area:
        return sum(_vl_tokens(w, h) for w, h in control_sizes[:1])  # Edit: the VL sees the VAE-sized control
    return sum(_vl_tokens(*calculate_dimensions(vl_area, w / h)) for w, h in control_sizes)


def prompt_tokens(variant: str | None, control_sizes: Sequence[tuple[int, int]], vl_area: int = DEFAULT_VL_AREA,
                  caption_tokens: int = CAPTION_TOKENS) -> int:
    """Tokens of one sample's text stream: the controls' vision tokens plus a long caption. `variant` empty
    or None (not known before the model is read): the longest any variant that takes this many controls would give."""
    if not variant:
        names = [v.name for v in variants.VARIANTS.values()
                 if v.max_controls is None or len(control_sizes) <= v.max_controls]
        return max(prompt_tokens(name, control_sizes, vl_area, caption_tokens) for name in names)
    return vision_tokens(variant, control_sizes, vl_area) + caption_tokens
