"""The model: variants, prompt templates, devices, loading (directories and ComfyUI single files), the tiny
offline factory, and the encoders' maths (prompt + images -> embeddings, images <-> latents)."""
