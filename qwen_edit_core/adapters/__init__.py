"""What is added to the transformer: LoRA adapters (inject, files, merge) and the multi-resolution adapter
(per-sample RoPE and joint-mask attention for mixed sizes in one batch)."""
