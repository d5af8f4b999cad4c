"""Training jobs beside ComfyUI's queue, with a fake run and a fake ComfyUI server: attach on re-queue, find
by name, stop with a checkpoint, LoRA delivered unattended, the status node letting the queue go, websocket
events, the HTTP routes, and checkpoints on shutdown (a real tiny run in a child process)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import nodes
from nodes import comfy_runtime, job_service
from qwen_edit_core import jobs, shutdown
from qwen_edit_core.common.progress import Progress
from qwen_edit_core.config import load_config
from qwen_edit_core.train.loop import TrainResult

ROOT = Path(__file__).resolve().parents[2]


class StepGate:
    """A fake run: one step per `release()`, stops (as the trainer does) when cancelled."""

    def __init__(self):
        self.gate = threading.Semaphore(0)
        self.resumes = []
        self.done_steps = threading.Condition()
        self.step = 0
        self.files = False  # write (and report, as the trainer does) a checkpoint and a validation image per step
        self.loss = lambda step: 1.0 / step  # the loss each step reports

    def release(self, n=1, wait=True):
        """Let `n` more steps run (and wait until they did)."""
        with self.done_steps:
            target = self.step + n
        for _ in range(n):
            self.gate.release()
        if wait:
            with self.done_steps:
                assert self.done_steps.wait_for(lambda: self.step >= target, timeout=60)

    def __call__(self, config, *, resume, progress, cancel, lock=None, model=None):
        self.resumes.append(resume)  # `self.step` counts every run's steps (release() may come before a run starts)
        out, total, step, state = Path(config.train.output_dir), config.train.max_steps, 0, "done"
        while step < total:
            while not self.gate.acquire(timeout=0.01):
                if cancel.cancelled:
                    break
            if cancel.cancelled:
                state = "cancelled"
                break
            step += 1
            progress(Progress("train", step, total, loss=self.loss(step)))
            if self.files:
                self.write_files(out, step, total, progress)
            with self.done_steps:
                self.step += 1
                self.done_steps.notify_all()
        out.mkdir(parents=True, exist_ok=True)
        lora = out / f"{config.train.lora_name}.safetensors"
        lora.write_text(f"{state} at {step}")
        return TrainResult(state=state, step=step, lora_path=lora, loss_plot=None)

    @staticmethod
    def write_files(out: Path, step: int, total: int, progress) -> None:
        checkpoint = out / "checkpoints" / f"step-{step:07d}"
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "state.json").write_text(json.dumps({"step": step}))
        progress(Progress("checkpoint", step, total, path=checkpoint))
        latents = out / "validation" / f"step-{step:07d}.safetensors"
        latents.parent.mkdir(parents=True, exist_ok=True)
        latents.write_bytes(b"latents")
        latents.with_suffix(".png").write_bytes(b"png")
        progress(Progress("validation", step, total, path=latents))


def _config(tmp_path, name="lora_a", steps=5, device="cpu", **train):
    return load_config(overrides={"train": {"output_dir": str(tmp_path / "runs" / name), "max_steps": steps,
                                            "lora_name": name, "device": device, **train}})


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fresh registry with a fake run, wired like the pack wires the real one, and a fake loras folder."""
    monkeypatch.setenv("QWEN_EDIT_LORAS", str(tmp_path / "loras"))
    run = StepGate()
    registry = jobs.JobRegistry(fit=run, preflight=lambda config, resume: None)
    registry.set_delivery(job_service.deliver)
    monkeypatch.setattr(jobs, "REGISTRY", registry)
    run.registry = registry
    yield run
    for job in registry.running():
        job.stop()
        job.wait()


class FakeServer:
    """What the pack uses of ComfyUI's PromptServer: send_sync, client_id, the queue's length, routes."""

    def __init__(self, queued=1):
        self.client_id, self.sent, self.queued = "client-1", [], queued
        self.prompt_queue = self

    def get_tasks_remaining(self):
        return self.queued

    def send_sync(self, event, data, sid=None):
        self.sent.append((event, json.loads(json.dumps(data)), sid))


def test_requeue_attaches_to_the_running_job_and_other_settings_refuse(fake, tmp_path):
    job = fake.registry.start(_config(tmp_path), resume=None)
    assert fake.registry.start(_config(tmp_path)) is job  # the same graph queued again
    with pytest.raises(jobs.JobBusyError, match="'lora_a' already runs with other settings"):
        fake.registry.start(_config(tmp_path, steps=9))
    with pytest.raises(jobs.JobBusyError, match=r"already runs on cpu \('lora_a'"):
        fake.registry.start(_config(tmp_path, name="lora_b"))
    fake.release(5)
    assert job.wait().state == "done"
    assert fake.registry.start(_config(tmp_path)) is job  # finished with the same settings: no retraining
    assert fake.resumes == [None]
    again = fake.registry.start(_config(tmp_path, steps=7), resume=True)  # more steps: a new job, resumed
    assert again is not job and fake.registry.get("lora_a") is again
    fake.release(7)
    assert again.wait().step == 7 and fake.resumes == [None, True]


def test_a_preflights_checks_run_before_the_output_folder_exists_and_its_probe_with_the_lock(tmp_path):
    """A job's own preflight: its check (writes nothing) before the lock creates the output folder, a refused
    check leaving no folder; its probe with the lock held, a refused probe releasing it."""
    from qwen_edit_core.common.files import OutputLock
    seen = []

    def check(config, resume):
        seen.append(("check", Path(config.train.output_dir).exists()))

    def probe(config, resume):
        seen.append(("probe", Path(config.train.output_dir).exists()))
        raise ValueError("probe refused")

    registry = jobs.JobRegistry(fit=StepGate(), preflight=jobs.Preflight(check=check, probe=probe))
    with pytest.raises(ValueError, match="probe refused"):
        registry.start(_config(tmp_path))
    assert seen == [("check", False), ("probe", True)] and registry.jobs() == []
    OutputLock(tmp_path / "runs" / "lora_a").acquire().release()  # released when the probe refused

    def refuse(config, resume):
        raise ValueError("bad setting")

    with pytest.raises(ValueError, match="bad setting"):
        jobs.JobRegistry(fit=StepGate(), preflight=refuse).start(_config(tmp_path, name="lora_b"))
    assert not (tmp_path / "runs" / "lora_b").exists()


def test_status_node_finds_a_job_by_name_and_stop_node_stops_it(fake, tmp_path):
    job = fake.registry.start(_config(tmp_path, steps=100))
    fake.release(3)
    status = nodes.QwenEditTrainStatus().status(False, job_name="lora_a")
    assert status["result"][0] == ""  # not finished: no LoRA yet
    assert "still running" in status["ui"]["text"][0]
    with pytest.raises(jobs.JobNotFoundError, match=r"no training job named 'nope'.*\['lora_a'\]"):
        nodes.QwenEditTrainStatus().status(False, job_name="nope")
    with pytest.raises(ValueError, match="job_name"):
        nodes.QwenEditStopTraining().stop("")
    out = nodes.QwenEditStopTraining().stop("lora_a")
    final = job.status()
    assert final.state == "cancelled" and 3 <= final.step < 100
    assert out["result"][0].startswith("lora_a: cancelled")
    listed = nodes.QwenEditJobs().list()["result"][0]
    assert listed.startswith(f"lora_a: cancelled, step {final.step}/100")
    # The stopped job's LoRA was delivered too, and the status node reports it by the JOB link.
    done = nodes.QwenEditTrainStatus().status(True, job=job)
    assert done["result"][0] == "lora_a.safetensors"
    assert Path(done["result"][1]).read_text() == f"cancelled at {final.step}"


def test_training_status_says_a_non_finite_loss_and_gives_nan_before_the_first_step(fake, tmp_path):
    node = nodes.QwenEditTrainStatus
    assert len(node.OUTPUT_TOOLTIPS) == len(node.RETURN_TYPES)
    assert "NaN before the first logged step" in node.OUTPUT_TOOLTIPS[node.RETURN_NAMES.index("loss")]
    fake.loss = lambda step: float("nan")
    job = fake.registry.start(_config(tmp_path, steps=100))
    out = node().status(False, job=job)
    assert "no loss yet" in out["ui"]["text"][0] and math.isnan(out["result"][4])
    fake.release(1)
    out = node().status(False, job=job)
    assert ", step 1/100, loss nan (not finite)" in out["ui"]["text"][0] and math.isnan(out["result"][4])
    fake.loss = lambda step: float("inf")
    fake.release(1)
    assert ", step 2/100, loss inf (not finite)" in node().status(False, job=job)["ui"]["text"][0]


def test_a_finished_job_delivers_its_lora_with_nobody_waiting(fake, tmp_path):
    job = fake.registry.start(_config(tmp_path, steps=2))
    fake.release(2)
    job.wait()  # joins the job's thread only; no status node ran
    delivered = tmp_path / "loras" / "lora_a.safetensors"
    assert delivered.read_text() == "done at 2" and job.status().delivered == delivered


def test_status_wait_lets_the_queue_go_when_another_prompt_waits(fake, tmp_path, monkeypatch):
    server = FakeServer(queued=2)  # the running prompt and one more
    monkeypatch.setattr(comfy_runtime, "prompt_server", lambda: server)
    job = fake.registry.start(_config(tmp_path, steps=50))
    fake.release(1)
    out = nodes.QwenEditTrainStatus().status(True, job=job)
    assert not job.finished and out["result"][0] == ""
    server.queued = 1  # alone in the queue: the node waits for the end
    fake.release(49)
    out = nodes.QwenEditTrainStatus().status(True, job=job)
    assert out["result"][0] == "lora_a.safetensors" and out["ui"]["text"][0].startswith("lora_a: done, step 50/50")


def test_every_step_is_broadcast_as_a_websocket_event(fake, tmp_path, monkeypatch):
    server = FakeServer()
    monkeypatch.setattr(comfy_runtime, "prompt_server", lambda: server)
    fake.registry.subscribe(job_service.send_job_event)
    job = fake.registry.start(_config(tmp_path, steps=3))
    fake.release(3)
    job.wait()
    events = [data for event, data, sid in server.sent if event == job_service.EVENT]
    assert all(sid is None for _, _, sid in server.sent)  # every browser, not only the one that queued
    assert [e["point"] for e in events if e["point"]] == [[1, 1.0], [2, 0.5], [3, pytest.approx(1 / 3)]]
    assert events[-1]["event"] == "finished" and events[-1]["state"] == "done"
    assert events[-1]["delivered"] == str(tmp_path / "loras" / "lora_a.safetensors")


class FakeRoutes:
    def __init__(self):
        self.handlers = {}

    def _add(self, method, path):
        def register(fn):
            self.handlers[(method, path)] = fn
            return fn
        return register

    def get(self, path):
        return self._add("GET", path)

    def post(self, path):
        return self._add("POST", path)


class FakeWeb:
    @staticmethod
    def json_response(data, status=200):
        return ("json", status, json.loads(json.dumps(data)))

    @staticmethod
    def FileResponse(path):
        return ("file", 200, Path(path))


class FakeRequest:
    def __init__(self, **match_info):
        self.match_info = match_info


def test_routes_list_stop_and_serve_the_latest_validation_image(fake, tmp_path):
    routes = FakeRoutes()
    job_service.register_routes(routes, FakeWeb, fake.registry)
    call = lambda method, path, **m: asyncio.run(routes.handlers[(method, path)](FakeRequest(**m)))  # noqa: E731
    job = fake.registry.start(_config(tmp_path, steps=100))
    fake.release(2)
    assert call("GET", "/qwen_edit/jobs/{name}/validation", name="lora_a")[1] == 404
    fake.files = True
    fake.release(1)
    validation = tmp_path / "runs" / "lora_a" / "validation"
    kind, code, body = call("GET", "/qwen_edit/jobs")
    (entry,) = body["jobs"]
    assert (kind, code, entry["name"], entry["total"]) == ("json", 200, "lora_a", 100)
    assert entry["step"] >= 3 and entry["history"][:2] == [[1, 1.0], [2, 0.5]]
    assert entry["validation_url"] == "/qwen_edit/jobs/lora_a/validation?step=0000003"
    assert call("GET", "/qwen_edit/jobs/{name}/validation", name="lora_a") == ("file", 200,
                                                                                validation / "step-0000003.png")
    assert call("POST", "/qwen_edit/jobs/{name}/stop", name="nope")[1] == 404
    assert call("POST", "/qwen_edit/jobs/{name}/stop", name="lora_a")[1] == 200
    assert job.wait().state == "cancelled"


def test_a_retrained_name_shows_only_its_own_run_files_and_steps_read_no_checkpoint(fake, tmp_path,
                                                                                       monkeypatch):
    """The live view of a job shows the validation image and checkpoint its own run wrote, never an earlier
    run's files left in the same folder (a LoRA name trained again), and a step's status reads no folder."""
    out = tmp_path / "runs" / "lora_a"
    StepGate.write_files(out, 900, 900, lambda event: None)  # an earlier run of the same name, further along
    from qwen_edit_core.train import checkpoint
    reads = []
    real_list = checkpoint.list_checkpoints
    monkeypatch.setattr(checkpoint, "list_checkpoints", lambda root: reads.append(root) or real_list(root))
    job = fake.registry.start(_config(tmp_path, steps=100))
    fake.release(2)
    status = job.status()
    assert (status.latest_validation, status.last_checkpoint) == (None, None)
    fake.files = True
    fake.release(2)
    status = job.status()
    assert status.latest_validation == out / "validation" / "step-0000004.png"
    assert status.last_checkpoint == out / "checkpoints" / "step-0000004"
    assert reads == []  # per-step status events read no checkpoint's state.json
    job.stop()
    job.wait()
    resumed = fake.registry.start(_config(tmp_path, steps=100), resume=True)
    fake.release(1, wait=False)
    assert resumed.status().last_checkpoint == out / "checkpoints" / "step-0000900"  # where it resumed from
    resumed.stop()
    resumed.wait()


def test_shutdown_handler_checkpoints_running_jobs_then_runs_the_previous_handler(fake, tmp_path):
    job = fake.registry.start(_config(tmp_path, steps=100))
    fake.release(1)
    seen = []
    handler = shutdown._chained(fake.registry, signal.SIGTERM, lambda sig, frame: seen.append(job.status().state))
    handler(signal.SIGTERM, None)
    assert seen == ["cancelled"] and job.status().delivered is not None


CHILD = """
import sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from pathlib import Path
from conftest import make_pairs
from qwen_edit_core import jobs
from qwen_edit_core.config import load_config
from qwen_edit_core.model.tiny import build_tiny
make_pairs(Path({data!r}), n=2)
config = load_config(overrides={{
    "model": {{"pretrained_model_name_or_path": str(build_tiny(Path({home!r}) / "tiny")), "dtype": "float32"}},
    "data": {{"folder": {data!r}, "vae_area": 64 * 64}}, "cache": {{"enabled": False}},
    "train": {{"output_dir": {out!r}, "max_steps": 100000, "checkpoint_every": 0,
                                  "lora_name": "shutdown", "device": "cpu"}}}})
from qwen_edit_core import shutdown
shutdown.install_shutdown_checkpoints()
jobs.REGISTRY.subscribe(lambda job, event: print("step", job.status().step, flush=True))
job = jobs.REGISTRY.start(config)
job.wait()
"""


@pytest.mark.slow  # a child process that trains
def test_sigterm_checkpoints_a_real_running_job(tmp_path):
    out = tmp_path / "out"
    code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), data=str(tmp_path / "data"), home=str(tmp_path),
                        out=str(out))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in child.stdout:  # synchronise on the child's own step events
            if line.startswith("step") and int(line.split()[1]) >= 2:
                break
        child.send_signal(signal.SIGTERM)
        child.stdout.read()
        assert child.wait(timeout=300) == -signal.SIGTERM  # the default handler ran after the checkpoint
    finally:
        if child.poll() is None:
            child.kill()
    from qwen_edit_core.train.checkpoint import latest_checkpoint
    found = latest_checkpoint(out / "checkpoints")
    assert found is not None and found.step >= 2 and (out / "shutdown.safetensors").is_file()


def test_the_live_view_extension_is_served_and_listens_to_the_pack_event():
    source = (ROOT / "__init__.py").read_text()
    assert 'WEB_DIRECTORY = "./web"' in source and '"WEB_DIRECTORY"' in source
    script = (ROOT / "web" / "qwen_edit_jobs.js").read_text()
    assert f'"{job_service.EVENT}"' in script and f'"{job_service.PREFIX}/jobs"' in script
    for node_id in ("QwenEditTrain", "QwenEditTrainStatus", "QwenEditStopTraining"):
        assert f'"{node_id}"' in script and node_id in nodes.NODE_CLASS_MAPPINGS
    # The view is a DOM widget that is never saved into a workflow's widget values (they go by position).
    assert "serialize: false" in script and "widget.serialize = false" in script


STUCK_CHILD = """
import signal, sys, threading
# Python's own Ctrl-C handler, which a parent that ignores SIGINT (a background launch: `nohup ... &`) does not pass on
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {root!r})
from qwen_edit_core import jobs, shutdown
from qwen_edit_core.config import load_config

started = threading.Event()

def fit(config, *, resume, progress, cancel, lock=None, model=None):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the kernel hands SIGINT to the main thread
    started.set()
    while not cancel.cancelled:
        cancel._event.wait()
    print("stopping", flush=True)  # asked for its checkpoint, which never completes (a hung write)
    threading.Event().wait()

registry = jobs.JobRegistry(fit=fit, preflight=lambda config, resume: None)
shutdown.install_shutdown_checkpoints(registry, wait={wait})
registry.start(load_config(overrides={{"train": {{"output_dir": {out!r}, "lora_name": "stuck", "device": "cpu"}}}}))
try:  # "running" is printed inside the try, so a signal sent once it is read lands here
    started.wait()
    print("running", flush=True)
    threading.Event().wait()
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


def _stuck_child(tmp_path, wait: float) -> subprocess.Popen:
    code = STUCK_CHILD.format(root=str(ROOT), out=str(tmp_path / "stuck"), wait=wait)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "running\n"  # the job runs and the handlers are installed
    return child


@pytest.mark.slow  # a child process
def test_a_second_ctrl_c_quits_while_the_first_waits_for_a_checkpoint(tmp_path):
    child = _stuck_child(tmp_path, wait=3600)
    try:
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline() == "stopping\n"  # the first Ctrl-C waits for the job's checkpoint
        child.send_signal(signal.SIGINT)  # the second one falls through to Python's own handler
        assert child.wait(timeout=60) == 3 and child.stdout.read() == "interrupted\n"
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.slow  # a child process
def test_the_shutdown_wait_for_a_checkpoint_is_bounded(tmp_path):
    child = _stuck_child(tmp_path, wait=0.5)
    try:
        child.send_signal(signal.SIGINT)  # the job never finishes its checkpoint: the wait gives up
        assert child.wait(timeout=60) == 3 and child.stdout.read() == "stopping\ninterrupted\n"
        assert "did not finish its checkpoint within 0 s" in child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
def test_the_heldout_metrics_reach_the_job_list_the_status_node_and_the_live_view(fake, tmp_path):
    """The held-out pairs' rows of validation/metrics.csv appear in the job's entry (what the live view draws:
    its `validation_metrics`, `pixel_mse`) and in the status node's text with the step of the lowest error."""
    routes = FakeRoutes()
    job_service.register_routes(routes, FakeWeb, fake.registry)
    job = fake.registry.start(_config(tmp_path, steps=100))
    fake.release(2)
    validation = tmp_path / "runs" / "lora_a" / "validation"
    validation.mkdir(parents=True)
    (validation / "metrics.csv").write_text("step,latent_mse,pixel_mse,pixel_mse_in_mask,pixel_mse_out_mask\n"
                                            "10,1.5,0.25,,\n20,1.25,0.125,0.5,0.0625\n30,1.375,0.1875,,\n")
    (entry,) = asyncio.run(routes.handlers[("GET", "/qwen_edit/jobs")](FakeRequest()))[2]["jobs"]
    assert entry["validation_metrics"] == [
        {"step": 10, "latent_mse": 1.5, "pixel_mse": 0.25, "pixel_mse_in_mask": None, "pixel_mse_out_mask": None},
        {"step": 20, "latent_mse": 1.25, "pixel_mse": 0.125, "pixel_mse_in_mask": 0.5, "pixel_mse_out_mask": 0.0625},
        {"step": 30, "latent_mse": 1.375, "pixel_mse": 0.1875, "pixel_mse_in_mask": None,
         "pixel_mse_out_mask": None}]
    text = nodes.QwenEditTrainStatus().status(False, job=job)["ui"]["text"][0]
    assert "held-out pixel MSE 0.1875 (latent 1.3750; lowest 0.1250 at step 20)" in text
    script = (ROOT / "web" / "qwen_edit_jobs.js").read_text()
    assert "entry.validation_metrics" in script and "r.pixel_mse" in script
    job.stop()
    job.wait()


def test_a_signal_sent_to_another_thread_is_handled_while_the_main_thread_waits_for_a_job(tmp_path):
    """The kernel may hand Ctrl-C to any thread (here the job's): a job's wait on the main thread, which the
    shutdown's checkpoint wait is, still lets the signal's handler run at once (a second Ctrl-C quits then, not
    after the whole bounded wait). In process, so it runs in the default suite."""
    release = threading.Event()

    def fit(config, *, resume, progress, cancel, lock=None, model=None):
        release.wait()
        raise RuntimeError("released")

    registry = jobs.JobRegistry(fit=fit, preflight=lambda config, resume: None)
    job = registry.start(load_config(overrides={"train": {"output_dir": str(tmp_path / "out"), "lora_name": "w",
                                                          "device": "cpu"}}))

    class Interrupted(Exception):
        pass

    def handler(sig, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    # the main thread (and the sender it starts) block the signal: the kernel hands it to the job's thread
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        with pytest.raises(Interrupted):
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGUSR1)).start()
            job.wait(600)
        assert not job.finished
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])
        signal.signal(signal.SIGUSR1, previous)
        release.set()
        job.wait()


def test_an_interrupt_says_what_the_stopped_job_saved_and_delivered(fake, tmp_path, monkeypatch, caplog):
    server = FakeServer()
    monkeypatch.setattr(comfy_runtime, "prompt_server", lambda: server)
    fake.registry.subscribe(job_service.send_job_event)  # the live view's events
    job = fake.registry.start(_config(tmp_path, steps=100))
    fake.files = True
    fake.release(2)

    class Interrupted(Exception):
        """ComfyUI's InterruptProcessingException"""

    def interrupted():
        raise Interrupted()

    monkeypatch.setattr(comfy_runtime, "interrupt_requested", lambda: True)
    monkeypatch.setattr(comfy_runtime, "raise_if_interrupted", interrupted)
    with pytest.raises(Interrupted):
        nodes.QwenEditTrainStatus().status(True, job=job)
    assert job.status().state == "cancelled"
    said = f"checkpoint step-0000002 saved; LoRA lora_a.safetensors delivered to {tmp_path / 'loras'}"
    assert f"training job 'lora_a' stopped; {said}" in caplog.text  # the server log
    # what the user sees: the live view's entry (its last event and the job list) and Training Status's text
    finished = [data for event, data, _ in server.sent if event == job_service.EVENT][-1]
    assert finished["event"] == "finished" and finished["outcome"] == said
    assert job_service.job_entry(job)["outcome"] == said
    monkeypatch.setattr(comfy_runtime, "interrupt_requested", lambda: False)
    text = nodes.QwenEditTrainStatus().status(False, job=job)["ui"]["text"][0]
    assert text.startswith("lora_a: cancelled, step 2/100") and text.endswith(f"({said})")
