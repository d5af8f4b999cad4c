"""A real ComfyUI server with this pack installed, on a fresh base directory, driven over HTTP."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger("comfy_test")

PACK = Path(__file__).resolve().parents[2]
PACK_DIR_NAME = "comfyui-qwen-edit-lora"
TRAIN_WORKFLOW = PACK / "example_workflows" / "qwen_edit_train_cached.json"


#: The calibration workload below, in seconds, on the machine where the checks' base time limits were set (the
#: limits are scaled by how much longer it takes on the machine running the checks: `machine_scale`): a 2-core
#: x86 machine at a load average of about 19, where the calibration took 9.1 s and the cached-training workflow
#: ran in 112 s, the sampling one in 50 s (900 s per workflow leaves room for the longest ones).
REFERENCE_WORK_S = 9.0
CALIBRATION = """
import time, torch
torch.manual_seed(0)
a, b = torch.randn(512, 512), torch.randn(512, 512)
x, w = torch.randn(1, 16, 64, 64), torch.randn(16, 16, 3, 3)
runs = []
for _ in range(3):
    start = time.perf_counter()
    for _ in range(40):
        (a @ b).sum(); torch.nn.functional.conv2d(x, w, padding=1).sum()
    runs.append(time.perf_counter() - start)
print(sorted(runs)[1])
"""
#: multiplies every time limit of the checks (set by run.py from `machine_scale`)
TIME_SCALE = 1.0
#: another frontend for the server to serve (`--front-end-root`, e.g. a newer comfyui-frontend-package's static/)
FRONT_END_ROOT: str | None = None


def machine_scale(python: str) -> tuple[float, float]:
    """(scale, seconds): how much longer than on the reference machine a fixed torch CPU workload (matmuls and
    convolutions, with torch's default threads, as the workflows run) takes in ComfyUI's Python here, the median of
    three (the best of three hid a busy machine's load), at least 1 (a slow or busy machine gets longer time limits,
    a fast one keeps the base ones)."""
    out = subprocess.run([python, "-c", CALIBRATION], capture_output=True, text=True, timeout=1800, check=True)
    seconds = float(out.stdout.split()[-1])
    return max(1.0, seconds / REFERENCE_WORK_S), seconds


def server_flags(comfyui_dir: Path) -> list[str]:
    """The flags that keep the paid API nodes out, as this ComfyUI spells them: `--disable-partner-nodes` where
    it exists (newer releases keep `--disable-api-nodes` only as a deprecated alias), else `--disable-api-nodes`."""
    cli = (Path(comfyui_dir) / "comfy" / "cli_args.py").read_text()
    flags = ["--disable-partner-nodes"] if '"--disable-partner-nodes"' in cli else ["--disable-api-nodes"]
    return flags + (["--front-end-root", FRONT_END_ROOT] if FRONT_END_ROOT else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def limit(seconds: float) -> float:
    """A time limit set on the reference machine, scaled to this one (TIME_SCALE)."""
    return seconds * TIME_SCALE


def poll(check, timeout: float, what: str, every: float = 0.25):
    """Call `check()` until it returns something truthy (returned) or `timeout` seconds (times the machine's
    TIME_SCALE) pass."""
    timeout *= TIME_SCALE
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class ComfyServer:
    """`python main.py --cpu` of the ComfyUI checkout at `comfyui_dir`, with the pack symlinked into
    `<base>/custom_nodes/`; `base` is a fresh temporary directory unless given (to restart on the same one), removed
    by `close()` (and on leaving a `with` block) when the server made it; `flags` go to main.py after ours."""

    def __init__(self, comfyui_dir: Path, python: str, base: Path | None = None, log_dir: Path | None = None,
                 flags: tuple[str, ...] = ()):
        self.comfyui_dir, self.python, self.flags = Path(comfyui_dir).resolve(), python, tuple(flags)
        self.owns_base = base is None
        self.base = Path(base) if base else Path(tempfile.mkdtemp(prefix="qwen_edit_comfy_"))
        self.log_dir = Path(log_dir or self.base)
        self.proc, self.port, self.starts = None, None, 0

    def start(self, timeout: float = 900) -> "ComfyServer":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"the server on port {self.port} is running: stop() it before starting it again")
        nodes_dir = self.base / "custom_nodes"
        nodes_dir.mkdir(parents=True, exist_ok=True)
        link = nodes_dir / PACK_DIR_NAME
        if not link.exists():
            link.symlink_to(PACK, target_is_directory=True)
        self.port, self.starts = free_port(), self.starts + 1
        self.log_path = self.log_dir / f"server-{self.base.name}-{self.starts}.log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                 "--base-directory", str(self.base), "--disable-auto-launch", *server_flags(self.comfyui_dir),
                 *self.flags],
                cwd=self.comfyui_dir, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            poll(lambda: self.proc.poll() is not None and self._died() or self._ready(), timeout,
                 "ComfyUI to start")
        except BaseException:
            self.stop()
            raise
        log.info("ComfyUI on port %d, base %s (log %s)", self.port, self.base, self.log_path)
        return self

    def _died(self):
        raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}; see {self.log_path}:\n"
                           + self.log_path.read_text()[-3000:])

    def _ready(self) -> bool:
        try:
            self.get("/system_stats")
            return True
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig=signal.SIGTERM, timeout: float = 300) -> int:
        """Send `sig` to our server process (by its PID) and wait for it to exit; returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(limit(timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=limit(30)) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict | None = None):
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=limit(60)) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"POST {path}: {err.code} {err.read().decode()[:2000]}") from None

    def queue(self, prompt: dict, workflow_id: str | None = None) -> str:
        """Queue `prompt`; with `workflow_id`, as the frontend queues a workflow (its id in extra_pnginfo)."""
        extra = {"extra_data": {"extra_pnginfo": {"workflow": {"id": workflow_id}}}} if workflow_id else {}
        return self.post("/prompt", {"prompt": prompt, "client_id": "qwen-edit-comfy-test", **extra})["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 900) -> dict:
        """The prompt's history entry once it ran; raises with ComfyUI's error when it failed."""
        entry = poll(lambda: self.get(f"/history/{prompt_id}").get(prompt_id), timeout, f"prompt {prompt_id}")
        status = entry.get("status", {})
        if status.get("status_str") != "success":
            errors = [m for m in status.get("messages", []) if m[0] == "execution_error"]
            detail = errors[0][1] if errors else status
            raise RuntimeError(f"prompt {prompt_id} failed: {json.dumps(detail)[:3000]}")
        return entry

    def run(self, prompt: dict, timeout: float = 900, workflow_id: str | None = None) -> dict:
        return self.wait(self.queue(prompt, workflow_id), timeout)

    def jobs(self) -> dict:
        return {job["name"]: job for job in self.get("/qwen_edit/jobs")["jobs"]}

    def job_where(self, name: str, check, timeout: float, what: str) -> dict:
        """Poll the pack's job route until job `name` satisfies `check(entry)`."""
        return poll(lambda: (lambda j: j if j and check(j) else None)(self.jobs().get(name)), timeout,
                    f"job {name!r}: {what}")

    def __enter__(self):
        return self.start()

    def close(self) -> int:
        """Stop the server and remove its base directory if it made it (the logs stay in `log_dir`); returns the
        server's exit code."""
        code = self.stop()
        if self.owns_base:
            shutil.rmtree(self.base, ignore_errors=True)
        return code

    def __exit__(self, *exc):
        self.close()
