"""Speed and memory levers for the transformer: fp8 base weights, selective checkpointing, regional compile,
block offloading, and the planner that picks them for a memory budget.

Each lever is a small function over a family's diffusers transformer (`Family.transformer_class`, with or
without peft LoRA layers) that changes only this model instance, through public APIs: module replacement, diffusers'
`enable_gradient_checkpointing(gradient_checkpointing_func=...)`, `torch.compile` per block, forward hooks.

Why these (the reference timings of BENCHMARKS.md, one H100 at 1024^2 Edit, and the commands there
that measure each lever): the frozen base's linear layers hold ~65% of the FLOPs and fp8 matmuls ran ~1.6x
faster than bf16 at their shapes; recomputing every block costs a full extra
forward per step when memory would hold many blocks' activations; the blocks' elementwise work (modulation,
RMSNorm, RoPE, GELU, fp8 quantization) is launch- and bandwidth-bound until compiled into few kernels.
"""

from qwen_edit_core.speed.attention import (ATTENTION_KERNELS, SDPA_KERNELS, attention_kernel, check_attention_kernel,
                                            kernel_shares, kernels_ran, kernels_text, offered_kernels)
from qwen_edit_core.speed.checkpointing import checkpoint_blocks, checkpointed_indices
from qwen_edit_core.speed.compile import CompileStats, compile_blocks, compile_stats, scales_as_inputs
from qwen_edit_core.speed.fp8 import FP8, FP8_MAX, Fp8Linear, fp8_matmul_supported, has_fp8, quantize_fp8, quantize_rows
from qwen_edit_core.speed.lending import give_back, lend, repark, shared_copy, unpark
from qwen_edit_core.speed.levers import (Levers, auto_budget_gb, configure_inference, configure_training,
                                        inference_copy, release_training, loaded_plan)
from qwen_edit_core.speed.host_memory import HostRegion
from qwen_edit_core.speed.offload import BlockOffloader, base_in_host_memory, layer_on_device, offload_indices
from qwen_edit_core.speed.weight_plan import WeightPlan, adapter_no_fp8, base_limits, checked_plan, plan_training
from qwen_edit_core.speed.planner import (MemoryEstimate, SpeedPlan, estimate_memory, free_memory_budget_gb,
                                         model_sizes, plan_for_budget, plan_seconds, resident_bytes)

__all__ = ["ATTENTION_KERNELS", "SDPA_KERNELS", "attention_kernel", "check_attention_kernel", "kernel_shares",
           "kernels_ran", "kernels_text", "offered_kernels",
           "checkpoint_blocks", "checkpointed_indices",
           "compile_blocks", "CompileStats", "compile_stats", "scales_as_inputs",
           "FP8", "FP8_MAX", "Fp8Linear", "fp8_matmul_supported", "has_fp8", "quantize_fp8", "quantize_rows",
           "Levers", "configure_inference", "configure_training", "inference_copy", "auto_budget_gb",
           "release_training",
           "lend", "give_back", "shared_copy", "unpark", "repark",
           "BlockOffloader", "base_in_host_memory", "layer_on_device", "HostRegion", "offload_indices",
           "MemoryEstimate", "SpeedPlan", "estimate_memory", "model_sizes", "plan_for_budget", "plan_seconds",
           "free_memory_budget_gb", "resident_bytes", "WeightPlan", "adapter_no_fp8", "base_limits", "checked_plan",
           "plan_training", "loaded_plan"]
