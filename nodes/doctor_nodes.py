"""The dataset doctor in ComfyUI: a dataset's flagged pairs as a picture (control, target, difference, finding per
row), its summary, and optionally a fixed copy of the folder."""

from __future__ import annotations

from qwen_edit_core import jobs
from qwen_edit_core.api import doctor_dataset

from . import comfy_runtime, loaded_models
from .common import CATEGORY, DATASET, TEXT_ENCODER, files_to_image
from .train_nodes import _folder


class QwenEditDatasetDoctor:
    """Checks what a dataset's pairs mean and shows the worst ones."""

    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["dataset doctor", "check dataset", "swapped pairs", "misaligned pairs", "duplicates"]
    DESCRIPTION = (
        "Checks a dataset's pairs before training: before/after swapped, targets shifted or zoomed against their "
        "control, references out of order, pairs with nothing changed, duplicates, held-out pairs that are also "
        "trained on, masks off the edited region, noisy captions and odd sizes. Shows the worst pairs (control, "
        "target, their difference, the finding) and the summary; with fix_folder it writes a fixed copy there "
        "(the dataset itself is never changed); with a text encoder connected it also asks it about each pair.")
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("flagged_pairs", "summary")
    FUNCTION = "check"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "dataset": (DATASET, {"tooltip": "the pairs to check (Dataset From Folder)"}),
            "pixel_aligned": ("BOOLEAN", {"default": False, "tooltip": "the edit keeps every pixel in place "
                                          "(data.pixel_aligned; control_size target implies it): shifted or zoomed "
                                          "targets are realigned in the fixed copy"}),
        }, "optional": {
            "held_out": ("STRING", {"default": "", "tooltip": "held-out validation pairs, as Train's "
                                    "validation_pairs: a number N (the last N pairs) or a folder; empty: none"}),
            "fix_folder": ("STRING", {"default": "", "tooltip": "a new folder for a fixed copy of the dataset "
                                      "(absolute, or relative to ComfyUI's input folder); empty: no copy"}),
            "text_encoder": (TEXT_ENCODER, {"tooltip": "optional: a loaded Qwen2.5-VL (Load Text Encoder) asked "
                                            "whether each target shows its caption's edit applied to its control; a "
                                            "no is a caption finding with its own description of the edit as the "
                                            "proposed caption. Slow: a generation per pair"}),
        }}

    def check(self, dataset, pixel_aligned, held_out="", fix_folder="", text_encoder=None):
        if text_encoder is not None:  # as every node that runs a model: never a job's, and on its device
            jobs.REGISTRY.check_free(text_encoder.model, "check a dataset")
            loaded_models.use(text_encoder)
        held = int(held_out) if held_out.strip().isdigit() else held_out.strip() or None
        out = comfy_runtime.output_dir() / "qwen_edit_doctor" / dataset.folder.name
        run = doctor_dataset(dataset.folder, held, pixel_aligned=pixel_aligned, out_dir=out, cache_dir=out / "cache",
                             fix_dir=_folder(fix_folder) if fix_folder.strip() else None,
                             comfyui_dir=comfy_runtime.comfyui_dir(),  # its bundled tokenizer counts the captions
                             text_encoder=text_encoder)
        summary = run.report.summary() + (f"\nfixed copy: {len(run.fixes)} fix(es) applied" if run.fixes else "")
        return {"ui": {"text": [summary]}, "result": (files_to_image([run.picture] if run.picture else []), summary)}
