"""The Sampler's `parallel` option in a real ComfyUI: the transformer on two CPU worker processes
(QWEN_EDIT_PARALLEL_DEVICES=cpu,cpu), two runs served by the same workers, the image of the run without it, and
no worker left once the server stops."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
from PIL import Image

from comfy import PACK, ComfyServer, poll
from convert import set_inputs, to_api

WORKFLOW = PACK / "example_workflows" / "qwen_edit_sample_with_lora.json"
DEVICES_ENV = "QWEN_EDIT_PARALLEL_DEVICES"


def _children(pid: int) -> set[int]:
    """The parallel workers the process `pid` started."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if "qwen_edit_core.sample.workers" in line}


def _image(server: ComfyServer, history: dict) -> np.ndarray:
    """The one image a run saved (SaveImage), as uint8."""
    images = [img for node in history["outputs"].values() for img in node.get("images", [])
              if img.get("type") == "output"]
    assert len(images) == 1, images
    path = server.base / "output" / images[0]["subfolder"] / images[0]["filename"]
    return np.asarray(Image.open(path), dtype=np.int16)


def check_parallel(args) -> list[str]:
    previous = os.environ.get(DEVICES_ENV)
    os.environ[DEVICES_ENV] = "cpu,cpu"  # the server's environment (ComfyServer passes ours on)
    try:
        with ComfyServer(args.comfyui_dir, args.python, log_dir=args.out) as server:
            prompt = to_api(json.loads(WORKFLOW.read_text()), server.get("/object_info"))
            before = _children(server.proc.pid)
            plain = _image(server, server.run(set_inputs(prompt, "QwenEditSampler", parallel=False)))
            first = _image(server, server.run(set_inputs(prompt, "QwenEditSampler", parallel=True)))
            workers = _children(server.proc.pid) - before
            second = _image(server, server.run(set_inputs(prompt, "QwenEditSampler", parallel=True, steps=3)))
            assert len(workers) == 2, f"expected 2 worker processes, found {sorted(workers)}"
            assert _children(server.proc.pid) - before == workers, "the second run started new workers"
            assert np.abs(first - plain).max() <= 1, "parallel and in-process images differ by more than 1/255"
            assert second.shape == plain.shape
            code = server.stop()
    finally:
        if previous is None:
            os.environ.pop(DEVICES_ENV, None)
        else:
            os.environ[DEVICES_ENV] = previous
    poll(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers), 60, "the workers to exit")
    difference = int(np.abs(first - plain).max())
    return [(f"2 workers (PIDs {sorted(workers)}) served both parallel runs; image equals the in-process one "
             f"(max difference {difference}/255); server exited with {code}, no worker left")]
