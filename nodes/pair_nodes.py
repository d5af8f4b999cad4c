"""Building a training dataset inside ComfyUI: before/after pairs from stock IMAGE outputs, with an optional
region mask from a stock MASK output, written into a dataset folder in the layout the trainer reads."""

from __future__ import annotations

import torch

from qwen_edit_core.data.pair_writer import NewPair, add_pairs

from .common import CATEGORY, DATASET, REFERENCES, DatasetHandle, image_to_pils
from .train_nodes import _folder


def _rows(name: str, tensor: torch.Tensor | None, count: int) -> list:
    """A batch input's rows for `count` pairs: its own rows, or its one row repeated."""
    if tensor is None:
        return [None] * count
    if tensor.shape[0] not in (1, count):
        raise ValueError(f"{name} has a batch of {tensor.shape[0]} but 'after' has {count}; give one {name} per "
                         "after image, or a single one for all")
    return [tensor[min(i, tensor.shape[0] - 1)] for i in range(count)]


def opaque_references(references) -> tuple:
    """Reference Images' pictures (PIL, RGB or RGBA) as RGB, in order; a picture with transparency is refused
    (dataset pictures are RGB: the trainer would not see its alpha)."""
    pictures = []
    for i, picture in enumerate(references or ()):
        if picture.mode in ("RGBA", "LA", "PA") and picture.getchannel("A").getextrema()[0] < 255:
            raise ValueError(f"reference {i + 1} has transparency, but dataset pictures are RGB; connect Reference "
                             "Images without a mask (or flatten the picture first)")
        pictures.append(picture.convert("RGB"))
    return tuple(pictures)


def comfy_pairs(before, after, caption, mask=None, before_2=None, before_3=None, references=None) -> list[NewPair]:
    """ComfyUI IMAGE batches (B, H, W, 3) and MASK (B, H, W) or (H, W), 1 = edited -> one NewPair per row, its
    controls in order: before, before_2, before_3, then every picture of `references` (a Reference Images chain,
    shared by every pair of the batch)."""
    count = after.shape[0]
    if mask is not None and mask.ndim == 2:
        mask = mask[None]
    given = [("before", before), ("before_2", before_2), ("before_3", before_3)]
    controls = [_rows(n, t, count) for n, t in given if t is not None]
    extra = opaque_references(references)
    masks = _rows("mask", mask, count)
    targets = image_to_pils(after)
    return [NewPair(tuple(image_to_pils(row[None])[0] for row in rows) + extra, target, caption,
                    None if m is None else m.detach().to("cpu", torch.float32).numpy())
            for rows, target, m in zip(zip(*controls), targets, masks)]


class QwenEditSavePair:
    """Write before/after pairs (and the edited region's mask) into a dataset folder."""

    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["save pair", "dataset builder", "before after", "save training pair", "mask"]
    DESCRIPTION = (
        "Adds before/after edit pairs to a dataset folder, with the caption and an optional mask of the edited "
        "region, in the layout Dataset From Folder and training read (PREFIX_00001.png, PREFIX_00001_control"
        ".png, .txt, _mask.png); each run with new images adds the next number. The mask is a stock MASK with "
        "1 = edited (what you paint in the mask editor; Load Image's mask is 1 - alpha), written white = "
        "edited; Train's mask_weight sets how much that region counts in the loss. More controls (Qwen-Image-"
        "2.1: up to 10 in all) come in order from before_2, before_3 and a Reference Images chain on references. "
        "Masks are saved with their "
        "pair rather than given to the Train node because each pair's edited region is its own and the "
        "dataset keeps them for every later run (cached or not).")
    RETURN_TYPES = (DATASET, "STRING")
    RETURN_NAMES = ("dataset", "summary")
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "before": ("IMAGE", {"tooltip": "the control image(s) to edit (a batch writes one pair per image)"}),
            "after": ("IMAGE", {"tooltip": "the edited result(s), the training target (at least 64 px per side)"}),
            "caption": ("STRING", {"default": "", "multiline": True, "placeholder": "caption: the edit, e.g. invert "
                                   "the colors",
                                   "tooltip": "the edit instruction, e.g. 'invert the colors' (one for the whole "
                                              "batch)"}),
            "folder": ("STRING", {"default": "my_edit_pairs", "tooltip": "the dataset folder: absolute, or "
                                  "relative to ComfyUI's input folder (created if missing)"}),
            "name_prefix": ("STRING", {"default": "pair", "tooltip": "file names are PREFIX_00001, PREFIX_00002, "
                                       "... (the next number free in the folder)"}),
        }, "optional": {
            "mask": ("MASK", {"tooltip": "the edited region of the after image, 1 = edited (paint it in the "
                              "mask editor; Load Image gives 1 - alpha); the after image's size or a scaled "
                              "copy; InvertMask first if yours marks what to keep"}),
            "before_2": ("IMAGE", {"tooltip": "a second control image (Edit Plus 2509/2511 models take 1 to 3)"}),
            "before_3": ("IMAGE", {"tooltip": "a third control image (Edit Plus 2509/2511 models take 1 to 3)"}),
            "references": (REFERENCES, {"tooltip": "more control images after before_3 (or after the last "
                                                   "connected one), in order, the same for every pair of the "
                                                   "batch: a Reference Images chain, one node per picture size "
                                                   "(Qwen-Image-2.1 models take 1 to 10 references in all)"}),
        }}

    def save(self, before, after, caption, folder, name_prefix, mask=None, before_2=None, before_3=None,
             references=None):
        path = _folder(folder)
        written, report = add_pairs(path, comfy_pairs(before, after, caption, mask, before_2, before_3, references),
                                    name_prefix)
        masked = sum(w.mask is not None for w in written)
        total = len(report.examples)
        summary = (f"wrote {', '.join(w.name for w in written)} ({masked} with a mask) to {path}; the folder has "
                   f"{total} pair{'' if total == 1 else 's'}, {sum(e.mask is not None for e in report.examples)} "
                   "with a mask"
                   + (f"; {len(report.skipped)} problem(s) in other pairs skipped, first: {report.skipped[0]}"
                      if report.skipped else ""))
        # the report skipped other pairs' problems (add_pairs), as the summary says: training reads the folder so too
        return {"ui": {"text": [summary]}, "result": (DatasetHandle(path, report, skip_invalid=True), summary)}
