"""`make comfy-test` (tools/comfy_test) runs and reports every shipped workflow once whatever one of them raises (a
timeout included), scales its time limits to the machine, starts ComfyUI without deprecated flags, and leaves no
folder behind: not in the system's temporary folder, not under --out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "comfy_test"
#: the tool's modules, imported by their plain names as run.py does (taken out of sys.modules after each test:
#: "comfy" is also the name of ComfyUI's own package, which other tests fake)
MODULES = ("comfy", "run", "convert", "edit_check", "thumbnails")


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOL))
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import comfy
    import run
    yield comfy, run
    for name in MODULES:
        sys.modules.pop(name, None)


class _FakeServer:
    """Stands in for a ComfyUI server: the first workflow times out, the second fails, the rest succeed."""

    calls: list = []

    def __init__(self, *args, base=None, **kwargs):
        self.base = Path("/nonexistent")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def get(self, path):
        return {}

    def post(self, path, body=None):
        _FakeServer.calls.append(("post", path))

    def run(self, prompt, timeout=900):
        _FakeServer.calls.append(("run", timeout))
        count = sum(1 for c in _FakeServer.calls if c[0] == "run")
        if count == 1:
            raise TimeoutError("timed out after 900 s waiting for prompt p")
        if count == 2:
            raise KeyError("broken")
        return {"outputs": {}}


def test_every_workflow_is_run_and_reported_after_a_timeout(tool, monkeypatch, tmp_path):
    comfy, run = tool
    monkeypatch.setattr(run, "ComfyServer", _FakeServer)
    monkeypatch.setattr(run, "to_api", lambda workflow, info: {})
    monkeypatch.setattr(run, "check_edits", lambda base: ["edit one", "edit two"])
    monkeypatch.setattr(run, "keep_thumbnail", lambda *a: "thumbnail kept")
    monkeypatch.setattr(comfy, "TIME_SCALE", 2.5)
    _FakeServer.calls = []
    args = type("Args", (), {"comfyui_dir": tmp_path, "python": "python", "out": tmp_path, "write_thumbnails": False,
                           "workflows": ""})
    with pytest.raises(RuntimeError) as failed:
        run.check_workflows(args)
    message = str(failed.value)
    names = [p.name for p in run.WORKFLOWS]
    limits = [run.workflow_limit(p.stem) for p in run.WORKFLOWS]
    assert [c for c in _FakeServer.calls if c[0] == "run"] == [("run", limit) for limit in limits]
    assert ("post", "/interrupt") in _FakeServer.calls  # the timed-out prompt is interrupted
    assert message.startswith(f"2 of {len(names)} workflows failed")
    assert f"{names[0]}: TimeoutError" in message and f"(limit {limits[0] * 2.5:.0f} s)" in message
    assert f"{names[1]}: KeyError" in message
    assert all(message.count(name) == 1 for name in names)  # the rest ran and are listed as ok, each once


def test_time_limits_follow_the_machine(tool, monkeypatch):
    """`poll` waits TIME_SCALE times its limit; the scale is the calibration's time over the reference's, never
    below 1."""
    comfy = tool[0]
    monkeypatch.setattr(comfy, "TIME_SCALE", 3.0)
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(comfy.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(comfy.time, "sleep", lambda s: None)
    with pytest.raises(TimeoutError, match="after 30 s"):
        comfy.poll(lambda: None, 10, "nothing")

    class Done:
        def __init__(self, seconds):
            self.stdout = f"warming up\n{seconds}\n"

    monkeypatch.setattr(comfy.subprocess, "run", lambda *a, **k: Done(comfy.REFERENCE_WORK_S * 4))
    assert comfy.machine_scale("python") == (pytest.approx(4.0), pytest.approx(comfy.REFERENCE_WORK_S * 4))
    monkeypatch.setattr(comfy.subprocess, "run", lambda *a, **k: Done(comfy.REFERENCE_WORK_S / 2))
    assert comfy.machine_scale("python")[0] == 1.0


def test_each_workflow_has_three_times_the_time_its_note_states_at_least(tool):
    """The longest shipped workflow (real-time training, measured at 811 s at a load of 12-19) gets three times
    that; a short one keeps the base limit; every Note's time has a limit at least three times it."""
    _, run = tool
    seconds = run._shipped_seconds()
    assert seconds.keys() == {p.stem for p in run.WORKFLOWS}
    assert run.workflow_limit("qwen_edit_train_realtime") == 3 * seconds["qwen_edit_train_realtime"] > 900
    assert run.workflow_limit("qwen_edit_masked_pairs") == run.WORKFLOW_LIMIT_S
    assert all(run.workflow_limit(name) >= 3 * s for name, s in seconds.items())


def test_the_calibration_is_the_median_of_three_runs(tool):
    """A busy machine's load shows in the median; the best of three runs could miss it."""
    comfy = tool[0]
    assert "sorted(runs)[1]" in comfy.CALIBRATION and "range(3)" in comfy.CALIBRATION


def test_comfyui_is_started_without_deprecated_flags(tool, tmp_path):
    """Newer ComfyUI keeps --disable-api-nodes only as a deprecated alias of --offline; its own flag for keeping
    the paid nodes out is --disable-partner-nodes. 0.3.64 has only the former."""
    comfy = tool[0]
    cli = tmp_path / "comfy" / "cli_args.py"
    cli.parent.mkdir()
    cli.write_text('parser.add_argument("--disable-api-nodes", action="store_true")\n')
    assert comfy.server_flags(tmp_path) == ["--disable-api-nodes"]
    cli.write_text('parser.add_argument("--disable-partner-nodes", action="store_true")\n'
                   'parser.add_argument("--disable-api-nodes", action="store_true", help="Deprecated alias")\n')
    assert comfy.server_flags(tmp_path) == ["--disable-partner-nodes"]


def test_each_passing_workflow_is_one_pass_line(tool, monkeypatch, tmp_path):
    comfy, run = tool
    monkeypatch.setattr(run, "ComfyServer", _FakeServer)
    monkeypatch.setattr(run, "to_api", lambda workflow, info: {})
    monkeypatch.setattr(run, "check_edits", lambda base: ["edit one", "edit two"])
    monkeypatch.setattr(run, "keep_thumbnail", lambda *a: "thumbnail kept")
    _FakeServer.calls = [("run", 0), ("run", 0)]  # past the fake's two failures
    args = type("Args", (), {"comfyui_dir": tmp_path, "python": "python", "out": tmp_path, "write_thumbnails": False,
                           "workflows": ""})
    lines = run.check_workflows(args)
    assert [line.split(":")[0] for line in lines] == [p.name for p in run.WORKFLOWS]
    assert all("edit one; edit two; thumbnail kept" in line for line in lines)


def test_a_run_leaves_no_folder_behind(tool, monkeypatch, tmp_path):
    """The servers' fresh base directories, and every other temporary folder of the run and its children, are
    under --out while it runs and gone when it ends; a server removes the base it made when it closes."""
    import os
    import tempfile

    comfy, run = tool
    server = comfy.ComfyServer(tmp_path, "python")
    assert server.base.is_dir()
    given = comfy.ComfyServer(tmp_path, "python", base=server.base)
    given.close()
    assert server.base.is_dir()  # a base it was given stays (a restart on the same one)
    server.close()
    assert not server.base.exists()

    (tmp_path / "ComfyUI").mkdir()
    (tmp_path / "ComfyUI" / "main.py").write_text("")
    seen = {}

    def checks(args):
        seen["base"] = comfy.ComfyServer(args.comfyui_dir, args.python).base  # never closed: a crashed check
        seen["tmpdir"] = os.environ["TMPDIR"]
        return 0

    monkeypatch.setattr(run, "_run_checks", checks)
    monkeypatch.setattr(run.signal, "signal", lambda *a: None)
    monkeypatch.setattr(tempfile, "tempdir", tempfile.gettempdir())
    monkeypatch.setenv("TMPDIR", tempfile.gettempdir())
    out = tmp_path / "out"
    assert run.main(["--comfyui-dir", str(tmp_path / "ComfyUI"), "--out", str(out)]) == 0
    assert seen["base"].parent == out.resolve() / "tmp" == Path(seen["tmpdir"])
    assert not seen["base"].exists() and sorted(p.name for p in out.iterdir()) == []


def test_a_workflow_is_queued_with_its_id_as_the_frontend_queues_it(tool, tmp_path):
    """The pack keys a loader's model by the workflow's id in extra_pnginfo: the job_models check queues two
    workflows whose Load Model is node 1 each with its own id, as the frontend does."""
    comfy = tool[0]
    server = comfy.ComfyServer(tmp_path, "python", base=tmp_path)
    sent = []
    server.post = lambda path, body: sent.append((path, body)) or {"prompt_id": "p"}
    assert server.queue({"1": {}}, workflow_id="w-1") == server.queue({"1": {}}) == "p"
    assert sent[0][1]["extra_data"] == {"extra_pnginfo": {"workflow": {"id": "w-1"}}}
    assert "extra_data" not in sent[1][1] and sent[0][0] == sent[1][0] == "/prompt"


def test_the_runner_reads_the_packs_own_modules_without_an_install(tmp_path):
    """ComfyUI's Python has the pack's requirements, not the pack: the runner (edit_check's edge similarity, the
    lifecycle check's checkpoints) imports qwen_edit_core from the checkout it runs from."""
    import os
    import subprocess
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]  # no install\n"
            "sys.path[:] = [p for p in sys.path if p and 'site-packages' in p or 'python3' in p]\n"
            f"sys.path.insert(0, {str(TOOL)!r})\n"
            "import run, qwen_edit_core\n"
            "print(qwen_edit_core.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).parent == TOOL.parents[1] / "qwen_edit_core"


def test_a_failed_workflow_is_in_the_fail_line_once(tool, monkeypatch, capsys, caplog):
    """The workflows check's summary names each failure with its reason; the runner prints it as the FAIL line
    alone (no traceback repeating it)."""
    comfy, run = tool

    def failing(args):
        raise run.ChecksFailed("1 of 2 workflows failed (1 ok: ['a.json']):\nb.json: KeyError after 1 s: 'x'")

    args = type("Args", (), {"front_end_root": None, "time_scale": 1.0, "only": "workflows"})
    monkeypatch.setattr(run, "check_workflows", failing)
    with caplog.at_level("INFO"):
        code = run._run_checks(args)
    printed = capsys.readouterr()
    everything = printed.out + printed.err + caplog.text
    assert code == 1 and everything.count("b.json") == 1 and everything.count("a.json") == 1, everything
