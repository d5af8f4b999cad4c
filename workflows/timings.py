"""The seconds each shipped workflow took, which its Note states (build_workflows.py) and from which `make comfy-test`
sets each workflow's time limit (tools/comfy_test/run.py). Plain data, read by both without importing the pack."""

#: how each workflow was timed (the seconds below: BENCHMARKS.md, "The shipped workflows in ComfyUI")
TIMED_BY = "python tools/comfy_test/run.py --only workflows --workflows {name} --comfyui-dir COMFYUI_DIR"
#: seconds each workflow took as shipped in ComfyUI 0.3.64 on a 2-core CPU (queue to finish, the server's start-up
#: excluded), by TIMED_BY; the machine's load for each: BENCHMARKS.md, "The shipped workflows in ComfyUI"
SECONDS = {"qwen_edit_build_cache": 185, "qwen_edit_masked_pairs": 10, "qwen_edit_sample_with_lora": 109,
           "qwen_edit_train_cached": 554, "qwen_edit_train_lightning_preview": 392, "qwen_edit_train_realtime": 811,
           "qwen_edit_train_then_sample": 655, "qwen_edit_two_gpu_cfg": 79, "qwen_image21_sample_references": 73,
           "qwen_image21_train_references": 100}
