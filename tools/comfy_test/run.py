"""Real-ComfyUI checks of the pack (`make comfy-test COMFYUI_DIR=...`): every shipped workflow on a fresh
base directory, the training-job lifecycle (attach, stop, restart with a checkpoint, LoRA delivered with
nobody waiting), the live view in headless Chromium on ComfyUI's own frontend (with a screenshot), and our
LoRA/LoKr/LoHa/DoRA files through stock LoraLoaderModelOnly (lora_check.py), a job's model beside another
workflow's Load Model of the same node id and ComfyUI's unload giving back our memory (job_models_check.py).

    python tools/comfy_test/run.py --comfyui-dir ~/ComfyUI [--python ~/ComfyUI/venv/bin/python]
                                   [--only workflows,lifecycle,browser] [--workflows NAME,...] [--out comfy_test_out]

Runs on the CPU with the built-in tiny model; needs nothing but a ComfyUI checkout whose Python has the
pack's requirements installed (and Debian's `chromium` for the browser check). Exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import comfy  # noqa: E402
from comfy import PACK, TRAIN_WORKFLOW, ComfyServer  # noqa: E402

# the checks read the pack's own helpers (qwen_edit_core: checkpoints, the demo's edge similarity) in this process;
# appended, so that nothing of the pack shadows ComfyUI's or the tool's modules
if str(PACK) not in sys.path:
    sys.path.append(str(PACK))
from convert import set_inputs, to_api  # noqa: E402
from edit_check import check_edits  # noqa: E402
from thumbnails import keep_thumbnail  # noqa: E402

log = logging.getLogger("comfy_test")
TEMPLATES = PACK / "example_workflows"
WORKFLOWS = sorted(TEMPLATES.glob("*.json"))
#: one workflow's time limit on the reference machine (comfy.REFERENCE_WORK_S), scaled by comfy.TIME_SCALE: this,
#: or MARGIN times the seconds the workflow's Note states (workflows/timings.py, measured at a load of up to 19 on
#: 2 cores), whichever is longer
WORKFLOW_LIMIT_S = 900
MARGIN = 3.0


@functools.cache
def _shipped_seconds() -> dict:
    """workflows/timings.py's SECONDS, read without importing the pack (plain data)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("workflow_timings", PACK / "workflows" / "timings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SECONDS


def workflow_limit(name: str) -> float:
    """The time limit of shipped workflow `name` on the reference machine (see WORKFLOW_LIMIT_S); ComfyServer.run
    scales it by comfy.TIME_SCALE."""
    return max(WORKFLOW_LIMIT_S, MARGIN * _shipped_seconds().get(name, 0))


class ChecksFailed(RuntimeError):
    """A check's complete account of its own failures (each named once, with its reason): reported as its FAIL line
    alone, without a traceback that would repeat it."""


def check_workflows(args) -> list[str]:
    """Every shipped workflow, each on its own fresh base directory (as on a fresh install), and its pictures
    showing the learned edit (edit_check.py); all are run (a timeout or any other error is reported for its
    workflow, and the next one runs), then any failure is raised. Each keeps its picture as its template
    thumbnail (thumbnails.py; into example_workflows/ with --write-thumbnails)."""
    results, failures = [], []
    chosen = [p for p in WORKFLOWS if not args.workflows or p.stem in args.workflows.split(",")]
    if not chosen:
        raise ValueError(f"--workflows {args.workflows}: none of {[p.stem for p in WORKFLOWS]}")
    for path in chosen:
        with ComfyServer(args.comfyui_dir, args.python, log_dir=args.out) as server:
            started = time.monotonic()
            try:
                entry = server.run(to_api(json.loads(path.read_text()), server.get("/object_info")),
                                   workflow_limit(path.stem))
                edits = check_edits(server.base)
                edits.append(keep_thumbnail(server, entry, path.stem, args.out,
                                            TEMPLATES if args.write_thumbnails else None))
            except Exception as err:  # noqa: BLE001 - every workflow is run and reported
                failures.append(f"{path.name}: {type(err).__name__} after {time.monotonic() - started:.0f} s "
                                f"(limit {workflow_limit(path.stem) * comfy.TIME_SCALE:.0f} s): {err}")
                log.error(failures[-1])
                if isinstance(err, TimeoutError):
                    server.post("/interrupt")  # then the server stops (SIGTERM) before the next workflow
                continue
            delivered = sorted(p.name for p in (server.base / "models" / "loras").glob("*.safetensors"))
            results.append(f"{path.name}: ok in {time.monotonic() - started:.1f} s (limit "
                           f"{workflow_limit(path.stem) * comfy.TIME_SCALE:.0f} s)"
                           + (f", LoRA in models/loras: {delivered}" if delivered else "")
                           + "".join(f"; {line}" for line in edits))  # one line per workflow
            log.info(results[-1])
    if failures:
        passed = [p.name for p in chosen if p.name not in {f.split(":")[0] for f in failures}]
        raise ChecksFailed(f"{len(failures)} of {len(chosen)} workflows failed ({len(passed)} ok: {passed}):\n"
                           + "\n".join(failures))
    return results


def _latest_checkpoint_step(base: Path, name: str) -> int:
    from qwen_edit_core.train.checkpoint import latest_checkpoint
    found = latest_checkpoint(base / "output" / "qwen_edit_runs" / name / "checkpoints")
    return found.step if found else -1


def check_lifecycle(args) -> list[str]:
    """Attach on re-queue, a waiting status node that lets the queue go, Stop Training with a checkpoint,
    SIGTERM checkpointing a running job and a restart resuming from it, and a LoRA delivered unattended."""
    name, results = "lifecycle", []
    server = ComfyServer(args.comfyui_dir, args.python, log_dir=args.out).start()
    try:
        base = to_api(json.loads(TRAIN_WORKFLOW.read_text()), server.get("/object_info"))
        long = set_inputs(base, "QwenEditTrainLoRA", lora_name=name, steps=100_000, checkpoint_every=0,
                          validation_every=0)
        background = set_inputs(long, "QwenEditTrainStatus", wait=False)
        server.run(background)
        first = server.job_where(name, lambda j: j["step"] >= 2, 600, "training")
        server.run({"1": {"class_type": "QwenEditJobs", "inputs": {}}})  # anything else in between
        server.run(background)  # the same graph again: attaches
        again = server.jobs()[name]
        assert again["step"] >= first["step"] and again["history"][0][0] == 1 and not again["finished"], again
        results.append(f"attach: re-queued graph attached to the running job (step {first['step']} -> "
                       f"{again['step']}, one job: {sorted(server.jobs())})")
        waiting = server.queue(long)  # wait on, holds the queue only until the next prompt arrives
        stop = server.queue({"1": {"class_type": "QwenEditStopTraining", "inputs": {"job_name": name}}})
        server.wait(waiting)
        server.wait(stop)
        stopped = server.jobs()[name]
        lora = server.base / "models" / "loras" / f"{name}.safetensors"
        assert stopped["state"] == "cancelled" and stopped["last_checkpoint"] and lora.is_file(), stopped
        results.append(f"wait + stop: the waiting status node let the Stop prompt run; job cancelled at step "
                       f"{stopped['step']} with checkpoint {Path(stopped['last_checkpoint']).name}, LoRA "
                       f"delivered to models/loras")
        results += _restart(server, background, name, stopped["step"])
        results.append(_unattended(server, base))
        results.append(_interrupt_signal(server, base))
    finally:
        server.close()
    return results


def _restart(server: ComfyServer, background: dict, name: str, stopped_at: int) -> list[str]:
    resumed = set_inputs(background, "QwenEditTrainLoRA", resume=True)
    server.run(resumed)
    server.job_where(name, lambda j: j["step"] >= stopped_at + 3 and not j["finished"], 600, "resumed training")
    code = server.stop()  # SIGTERM with the job running
    saved = _latest_checkpoint_step(server.base, name)
    assert saved >= stopped_at + 3, (saved, stopped_at)
    server.start()  # the same base directory
    final = saved + 3
    server.run(set_inputs(set_inputs(resumed, "QwenEditTrainLoRA", steps=final), "QwenEditTrainStatus", wait=True))
    job = server.jobs()[name]
    assert job["state"] == "done" and job["step"] == final and job["history"][0][0] == saved + 1, job
    return [f"SIGTERM: server exited with {code} after checkpointing the running job at step {saved}",
            f"restart: resumed from that checkpoint (first step {job['history'][0][0]}), done at step {final}"]


def _unattended(server: ComfyServer, base: dict) -> str:
    name = "unattended"
    prompt = set_inputs(set_inputs(base, "QwenEditTrainLoRA", lora_name=name, steps=6, validation_every=0),
                        "QwenEditTrainStatus", wait=False)
    server.run(prompt)
    job = server.job_where(name, lambda j: j["finished"], 600, "finishing with nobody waiting")
    lora = server.base / "models" / "loras" / f"{name}.safetensors"
    assert job["state"] == "done" and lora.is_file() and job["delivered"] == str(lora), job
    return f"unattended: job finished ({job['step']} steps) and its LoRA is in models/loras with nobody waiting"


def _interrupt_signal(server: ComfyServer, base: dict) -> str:
    """Ctrl+C (SIGINT) on the server checkpoints a running job too."""
    name = "sigint"
    prompt = set_inputs(set_inputs(base, "QwenEditTrainLoRA", lora_name=name, steps=100_000, checkpoint_every=0,
                                   validation_every=0), "QwenEditTrainStatus", wait=False)
    server.run(prompt)
    server.job_where(name, lambda j: j["step"] >= 2, 600, "training")
    code = server.stop(signal.SIGINT)
    saved = _latest_checkpoint_step(server.base, name)
    assert saved >= 2, saved
    return f"SIGINT: server exited with {code} after checkpointing the running job at step {saved}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui-dir", type=Path, required=True, help="a ComfyUI checkout (holds main.py)")
    parser.add_argument("--python", default=sys.executable, help="the Python of ComfyUI's environment")
    parser.add_argument("--only", default="workflows,lifecycle,browser,layout,view,frontend,lora,parallel,free_memory,"
                                          "model_memory,job_memory,job_models,unload_memory",
                        help="comma-separated checks: workflows, lifecycle, browser, layout, lora (our LoRA, LoKr, "
                             "LoHa and DoRA files through stock LoraLoaderModelOnly), parallel (the Sampler's "
                             "parallel option on 2 CPU workers), free_memory (the Train node's request to "
                             "ComfyUI to free a GPU), model_memory (the pack's models in ComfyUI's memory "
                             "manager; a loader run twice holds one transformer), job_memory (a running job stays "
                             "counted and loaded through ComfyUI's unloads), job_models (a real-time job trains on "
                             "while another workflow whose Load Model is also node 1 samples, ComfyUI's ledger "
                             "counting it through --disable-smart-memory's unloads), unload_memory "
                             "(ComfyUI's Free model and node cache gives back a real-width model's resident "
                             "memory), view (each workflow opened at "
                             "1920x1080 is readable), frontend (the live view inside a subgraph and with the Vue "
                             "node renderer; labelled text boxes); sizes re-measures workflows/frontend/node_sizes.json; "
                             "first_workflow saves the README's screenshot of the first workflow")
    parser.add_argument("--workflows", default="",
                        help="the workflows check runs only these example_workflows/ names (comma-separated stems, "
                             "e.g. qwen_image21_sample_references; default: every shipped workflow)")
    parser.add_argument("--out", type=Path, default=Path("comfy_test_out"), help="logs and the screenshot")
    parser.add_argument("--write-thumbnails", action="store_true",
                        help="the workflows check copies each workflow's picture into example_workflows/<name>.jpg")
    parser.add_argument("--chromium", default=None, help="chromium executable (default: from PATH)")
    parser.add_argument("--front-end-root", default=None,
                        help="serve this frontend instead of the installed one (ComfyUI's --front-end-root), e.g. a "
                             "newer comfyui-frontend-package's static/ folder")
    parser.add_argument("--time-scale", type=float, default=0.0,
                        help="multiply every time limit by this (default: measured, comfy.machine_scale)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not (args.comfyui_dir / "main.py").is_file():
        parser.error(f"--comfyui-dir {args.comfyui_dir}: no main.py there; point it at a ComfyUI checkout")
    args.out.mkdir(parents=True, exist_ok=True)
    # every temporary folder of this run and of the servers and browsers it starts (their fresh base directories,
    # profiles, the pack's own temporary files) goes under --out and is removed when the run ends
    work = (args.out / "tmp").resolve()
    work.mkdir(exist_ok=True)
    tempfile.tempdir = os.environ["TMPDIR"] = str(work)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return _run_checks(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_checks(args) -> int:
    comfy.FRONT_END_ROOT = args.front_end_root
    comfy.TIME_SCALE, seconds = (args.time_scale, None) if args.time_scale else comfy.machine_scale(args.python)
    print(f"time limits x{comfy.TIME_SCALE:.2f}" + (f" (calibration {seconds:.2f} s here, {comfy.REFERENCE_WORK_S:.2f} s "
          "on the reference machine)" if seconds else " (--time-scale)"), flush=True)
    from browser_check import check_browser
    from first_workflow_shot import first_workflow_shot
    from free_memory_check import check_free_memory
    from job_models_check import check_job_models, check_unload_memory
    from frontend_check import check_frontend
    from model_memory_check import check_model_memory
    from job_memory_check import check_job_memory
    from layout_check import check_layout, measure_sizes
    from lora_check import check_lora_kinds
    from parallel_check import check_parallel
    from view_check import check_view
    checks = {"workflows": check_workflows, "lifecycle": check_lifecycle, "browser": check_browser,
              "layout": check_layout, "sizes": measure_sizes, "lora": check_lora_kinds, "parallel": check_parallel,
              "free_memory": check_free_memory, "model_memory": check_model_memory,
              "job_memory": check_job_memory, "job_models": check_job_models, "unload_memory": check_unload_memory,
              "first_workflow": first_workflow_shot, "view": check_view, "frontend": check_frontend}
    failed = []
    for name in args.only.split(","):
        try:
            for line in checks[name](args):
                print(f"PASS {name}: {line}", flush=True)
        except Exception as err:  # noqa: BLE001 - report every check, then fail
            if not isinstance(err, ChecksFailed):
                log.exception("%s failed", name)
            failed.append(f"{name}: {type(err).__name__}: {err}")
    for line in failed:
        print(f"FAIL {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
