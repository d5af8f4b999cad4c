"""ComfyUI nodes of the pack: each is a schema plus one call into qwen_edit_core. Ids are prefixed
`QwenEdit` and never renamed; new inputs go last (saved workflows keep widget values by position)."""

from __future__ import annotations

from . import comfy_runtime, job_service
from .job_nodes import QwenEditJobs, QwenEditStopTraining
from .model_nodes import (QwenEditAssembleModel, QwenEditLoraLoader, QwenEditModelLoader, QwenEditSchedulerLoader,
                          QwenEditTextEncoderLoader, QwenEditTransformerLoader, QwenEditVAELoader)
from .sample_nodes import (QwenEditDecodeLatent, QwenEditEncodeImage, QwenEditEncodePrompt, QwenEditSampleConditioning,
                           QwenEditSampler, QwenEditSpeed)
from .doctor_nodes import QwenEditDatasetDoctor
from .pair_nodes import QwenEditSavePair
from .references import QwenEditReferenceImages
from .train_compact import QwenEditTrainLoRA, QwenEditTrainOptions
from .train_nodes import (QwenEditBuildCache, QwenEditDataset, QwenEditSyntheticDataset, QwenEditTrain,
                          QwenEditTrainStatus)

NODE_CLASS_MAPPINGS = {cls.__name__: cls for cls in (
    QwenEditModelLoader, QwenEditTransformerLoader, QwenEditVAELoader, QwenEditTextEncoderLoader,
    QwenEditSchedulerLoader, QwenEditAssembleModel, QwenEditLoraLoader,
    QwenEditEncodePrompt, QwenEditEncodeImage, QwenEditDecodeLatent, QwenEditSampler, QwenEditSampleConditioning,
    QwenEditSpeed,
    QwenEditDataset, QwenEditSyntheticDataset, QwenEditBuildCache, QwenEditTrain, QwenEditTrainStatus,
    QwenEditStopTraining, QwenEditJobs, QwenEditSavePair, QwenEditTrainLoRA, QwenEditTrainOptions,
    QwenEditReferenceImages, QwenEditDatasetDoctor)}

NODE_DISPLAY_NAME_MAPPINGS = {
    "QwenEditModelLoader": "Qwen Edit: Load Model (per-component devices)",
    "QwenEditTransformerLoader": "Qwen Edit: Load Transformer",
    "QwenEditVAELoader": "Qwen Edit: Load VAE",
    "QwenEditTextEncoderLoader": "Qwen Edit: Load Text Encoder",
    "QwenEditSchedulerLoader": "Qwen Edit: Load Scheduler",
    "QwenEditAssembleModel": "Qwen Edit: Assemble Model",
    "QwenEditLoraLoader": "Qwen Edit: Load LoRA",
    "QwenEditEncodePrompt": "Qwen Edit: Encode Prompt + Image",
    "QwenEditEncodeImage": "Qwen Edit: Encode Image (VAE)",
    "QwenEditDecodeLatent": "Qwen Edit: Decode Latent (VAE)",
    "QwenEditSampler": "Qwen Edit: Sampler (true CFG)",
    "QwenEditSampleConditioning": "Qwen Edit: Sample Conditioning",
    "QwenEditSpeed": "Qwen Edit: Sampling Speed (fp8, compile, attention)",
    "QwenEditDataset": "Qwen Edit: Dataset From Folder",
    "QwenEditSyntheticDataset": "Qwen Edit: Synthetic Demo Dataset",
    "QwenEditBuildCache": "Qwen Edit: Build Cache",
    "QwenEditTrain": "Qwen Edit: Train LoRA (all inputs, deprecated)",
    "QwenEditTrainLoRA": "Qwen Edit: Train LoRA (background)",
    "QwenEditTrainOptions": "Qwen Edit: Train Options (advanced)",
    "QwenEditTrainStatus": "Qwen Edit: Training Status / Wait",
    "QwenEditStopTraining": "Qwen Edit: Stop Training",
    "QwenEditJobs": "Qwen Edit: Training Jobs",
    "QwenEditSavePair": "Qwen Edit: Save Pair To Dataset (before/after + mask)",
    "QwenEditReferenceImages": "Qwen Edit: Reference Images (Qwen-Image-2.1, in order)",
    "QwenEditDatasetDoctor": "Qwen Edit: Dataset Doctor (flagged pairs)",
}

comfy_runtime.register_folders()
job_service.setup()

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
