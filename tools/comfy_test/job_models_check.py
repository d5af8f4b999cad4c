"""A training job's model beside other workflows, and ComfyUI's unload, in a real ComfyUI server.

`check_job_models`: two shipped workflows whose Load Model is node 1 (every shipped workflow's is), queued as the
frontend queues them (each with its own workflow id): the real-time training one with Training Status `wait` off,
then the sampling one while the job trains. With the same Load Model settings ComfyUI serves node 1's cached output,
the job's model, and sampling on it is refused naming the job and Load Model's `instance`; with instance 1 the sample
succeeds and the job keeps training on its own model (a real-time step runs its text encoder and VAE, which the
second load once moved to `meta`), then stops with a checkpoint and its LoRA delivered to models/loras, and the
same graph resumes and finishes. Throughout, ComfyUI's ledger (read through ledger_probe.py) lists the job once with
its bytes, the unload ComfyUI runs after every prompt (--disable-smart-memory) is declined, and none of the job's
weights is freed.

`check_unload_memory`: a real-width model (one block at the real widths, about 1.5 GB in float32) loaded by a
graph that samples one step, then ComfyUI's "Free model and node cache" (POST /free): the server's resident memory falls by most of the
model's bytes, as it does for ComfyUI's own loaders, and the same graph then runs again (the loader loads it
anew)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from comfy import PACK, ComfyServer, limit, poll
from convert import set_inputs, to_api

TEMPLATES = PACK / "example_workflows"
#: the test server's custom node that shows ComfyUI's list of loaded models (ledger_probe.py), and its route
LEDGER_PROBE = Path(__file__).resolve().with_name("ledger_probe.py")
LEDGER_ROUTE = "/comfy_test/loaded_models"
#: the share of the model's weight bytes the server's resident memory must give back after POST /free
RETURNED_SHARE = 0.6


def _workflow(name: str, object_info: dict) -> dict:
    return to_api(json.loads((TEMPLATES / f"{name}.json").read_text()), object_info)


def _job_entry(server: ComfyServer, name: str) -> dict:
    """The ledger row (ledger_probe.py) of training job `name`; fails unless ComfyUI lists exactly one, with bytes
    counted and none of the job's weights freed."""
    rows = server.get(LEDGER_ROUTE)
    entries = [row for row in rows if row.get("job") == name]
    assert len(entries) == 1, f"ComfyUI's loaded models should list job {name!r} once: {rows}"
    entry = entries[0]
    assert entry["bytes"] > 0 and entry["tensors"] > 0 and entry["freed"] == 0, entry
    return entry


def check_job_models(args) -> list[str]:
    """The server runs with --disable-smart-memory: ComfyUI then unloads every model of the device after each
    prompt (execution.py, 0.3.64), which on the CPU is the largest request for memory a prompt can make (ComfyUI's
    loaders free memory before a load only on a GPU)."""
    name = "node_one_job"
    server = ComfyServer(args.comfyui_dir, args.python, log_dir=args.out, flags=("--disable-smart-memory",))
    (server.base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    shutil.copy(LEDGER_PROBE, server.base / "custom_nodes" / "comfy_test_ledger_probe.py")
    with server:  # starts it
        info = server.get("/object_info")
        train = set_inputs(_workflow("qwen_edit_train_realtime", info), "QwenEditTrainLoRA", lora_name=name,
                           steps=100_000, checkpoint_every=0, validation_every=0)
        train = set_inputs(train, "QwenEditTrainStatus", wait=False)
        sample = _workflow("qwen_edit_sample_with_lora", info)
        assert train["1"]["class_type"] == sample["1"]["class_type"] == "QwenEditModelLoader", (train, sample)
        sample_id = str(uuid.uuid4())
        server.run(train, workflow_id=str(uuid.uuid4()))  # its end unloads every model: the job keeps its own
        server.job_where(name, lambda j: j["step"] >= 1 or j["finished"], 900, "the first real-time step")
        counted = _job_entry(server, name)
        try:  # the same settings give back ComfyUI's cached output of node 1: the job's own model
            server.run(sample, workflow_id=sample_id)
            raise AssertionError("sampling on the running job's model was not refused")
        except RuntimeError as refused:
            assert name in str(refused) and "instance" in str(refused), refused
        # another model (Load Model's instance 1) loads, samples, and is unloaded at the prompt's end
        server.run(set_inputs(sample, "QwenEditModelLoader", instance=1), workflow_id=sample_id)
        after = server.jobs()[name]
        assert after["state"] == "training", f"the job did not survive the other workflow's load: {after}"
        kept = _job_entry(server, name)
        assert kept["declined"] > counted["declined"] >= 1, (counted, kept)  # asked again, and declined again
        moved_on = server.job_where(name, lambda j: j["step"] >= after["step"] + 2 or j["finished"], 900,
                                    "two more real-time steps after the sample")
        assert moved_on["state"] == "training", f"the job failed after the other workflow's load: {moved_on}"
        server.run({"1": {"class_type": "QwenEditStopTraining", "inputs": {"job_name": name}}})
        stopped = server.jobs()[name]
        lora = server.base / "models" / "loras" / f"{name}.safetensors"
        assert stopped["state"] == "cancelled" and stopped["delivered"] == str(lora) and lora.is_file(), stopped
        # the same graph resumes on the model that went through those unloads and finishes: its LoRA delivered
        final = stopped["step"] + 2
        server.run(set_inputs(set_inputs(train, "QwenEditTrainLoRA", resume=True, steps=final),
                              "QwenEditTrainStatus", wait=True), workflow_id=str(uuid.uuid4()))
        done = server.jobs()[name]
        assert done["state"] == "done" and done["step"] == final and done["delivered"] == str(lora), done
    return [f"two workflows with Load Model as node 1: sampling on the job's model was refused naming the job and "
            f"`instance`; with instance 1 the sample ran while the real-time job trained (step {after['step']}), the "
            f"job went on to step {moved_on['step']}, stopped at step {stopped['step']} and delivered its LoRA to "
            "models/loras",
            f"memory: ComfyUI's ledger listed the running job once ({kept['bytes'] / 2**20:.1f} MiB counted) through "
            f"{kept['declined']} unloads of every model (--disable-smart-memory, after each prompt), none of its "
            f"{kept['tensors']} tensors freed; the resumed job finished at step {done['step']} and delivered its LoRA"]


def _rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def _real_width_model(python: str, folder: Path) -> int:
    """Build the real-width random model into `folder` in ComfyUI's Python; returns its weight files' bytes."""
    script = (f"import sys; sys.path.insert(0, {str(PACK)!r})\n"
              "from qwen_edit_core.model.tiny import build_tiny\n"
              f"build_tiny({str(folder)!r}, size='real-width')\n")
    subprocess.run([python, "-c", script], check=True, capture_output=True, text=True, timeout=limit(1200))
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def _free(server: ComfyServer, target_mb: float) -> float | None:
    """POST /free as the frontend's "Free model and node cache" button does, then the server's RSS if it fell to
    `target_mb`. Posted again at each poll: ComfyUI's prompt worker reads the request's flags only when it wakes
    from waiting for the queue, so a request that comes while it finishes a prompt (as this check's does) waits for
    the next prompt (main.py `prompt_worker`, execution.py `PromptQueue.set_flag`, 0.3.64 and current)."""
    server.post("/free", {"unload_models": True, "free_memory": True})
    rss = _rss_mb(server.proc.pid)
    return rss if rss <= target_mb else None


def check_unload_memory(args) -> list[str]:
    if not sys.platform.startswith("linux"):
        return ["skipped: resident memory is read from /proc (Linux only)"]
    with tempfile.TemporaryDirectory(prefix="qwen_edit_real_width_") as tmp:
        folder = Path(tmp) / "real-width"
        file_bytes = _real_width_model(args.python, folder)
        loader = {"model": "qwen-edit-tiny (built-in, random weights)", "transformer_device": "cpu",
                  "vae_device": "cpu", "text_encoder_device": "cpu", "dtype": "float32", "path": str(folder)}
        prompt = {"1": {"class_type": "QwenEditModelLoader", "inputs": loader},
                  "2": {"class_type": "QwenEditSyntheticDataset", "inputs": {"folder": "rss_pairs", "count": 2,
                                                                             "seed": 0}},
                  # one sampling step touches every weight (the loader's files are read lazily)
                  "3": {"class_type": "QwenEditSampler", "inputs": {
                      "model": ["1", 0], "image": ["2", 1], "prompt": "make it blue", "negative_prompt": "",
                      "steps": 1, "true_cfg_scale": 1.0, "seed": 0, "width": 64, "height": 64,
                      "shift_mode": "dynamic", "uncond_device": "same", "vae_side": 64}},
                  "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}}
        with ComfyServer(args.comfyui_dir, args.python, log_dir=args.out) as server:
            idle = _rss_mb(server.proc.pid)
            server.run(prompt)
            loaded = _rss_mb(server.proc.pid)
            model_mb = file_bytes / 2**20  # float32 files loaded as float32
            try:
                freed = poll(lambda: _free(server, loaded - RETURNED_SHARE * model_mb), 120,
                             "the server's resident memory to fall after POST /free", every=5)
            except TimeoutError:
                raise AssertionError(f"after POST /free the server kept its memory: RSS {loaded:.0f} MB loaded, "
                                     f"{_rss_mb(server.proc.pid):.0f} MB now, model {model_mb:.0f} MB") from None
            server.run(prompt)  # the loader loads the model again
    return [f"ComfyUI's Free model and node cache: server RSS {idle:.0f} MB idle, {loaded:.0f} MB with the "
            f"{model_mb:.0f} MB real-width model, {freed:.0f} MB after POST /free; the graph ran again after it"]
