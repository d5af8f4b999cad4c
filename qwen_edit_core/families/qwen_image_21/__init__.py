"""The Qwen-Image-2.1 family: its encoders, files, batches, sampler, toy model and benches."""
