"""The 2025 Qwen-Image family's memory-planner constants: speed/planner.py's defaults, which were fitted on it."""

#: what `speed.planner.model_sizes` takes from this family instead of its defaults: nothing
SIZES: dict = {}
