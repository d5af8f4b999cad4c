"""Qwen-Image-2.1's memory-planner constants (`speed.planner.model_sizes` reads `SIZES`)."""

#: speed/planner.py's constants for Qwen-Image-2.1, in units of its joint sequence (the text tokens less the
#: prompt's vision slots, plus every image token) x 4096 bf16 values, measured the same way (`qwen-edit bench memory
#: --variant image-2.1`: 2- and 4-block models at 1024^2 with one reference, 8,246 tokens). Its blocks save more per
#: token than the 2025 family's: the per-token modulation (`where` over the target's rows), fp32 rotary and q/k
#: norms, the SwiGLU MLP's three products; a checkpointed block saves its one input stream, as speed/planner.py's
#: `BOUNDARY_FACTOR` says. The fp8 base adds 5.0 to the working set (measured with checkpointing; taken as the same
#: without).
ACTIVATION_FACTOR_21 = 29.1
WORKING_FACTOR_21 = {(False, True): 44.3, (True, True): 49.3, (False, False): 14.2, (True, False): 19.2}
#: what `model_sizes` takes from this family instead of the 2025-fitted defaults
SIZES = {"activation_factor": ACTIVATION_FACTOR_21, "working_factor": WORKING_FACTOR_21}
