"""The job SDK's channel to the agent: no-op outside the platform, suspend flag, events."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hai import sdk
from hai.sdk import core


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for k in ("HAI_CONTROL_DIR", "HAI_RESUME_FROM", "HAI_CHECKPOINT_DIR", "RANK", "HAI_SUSPEND_CHECK_EVERY",
              "HAI_PROGRESS_INTERVAL_S"):
        monkeypatch.delenv(k, raising=False)
    core._reset()
    yield
    core._reset()


@pytest.fixture
def control(tmp_path, monkeypatch):
    d = tmp_path / "control"
    d.mkdir()
    monkeypatch.setenv("HAI_CONTROL_DIR", str(d))
    return d


def _events(control, rank=0):
    p = control / f"events.{rank}.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines()]


def test_every_call_is_a_harmless_noop_outside_the_platform(tmp_path):
    assert not sdk.on_platform()
    assert sdk.should_suspend() is False
    assert sdk.resume_path() is None
    sdk.report_checkpoint(str(tmp_path / "x.pt"), step=3)
    sdk.report_progress(1, 10, loss=0.1)
    sdk.suspend_ready()
    assert list(tmp_path.iterdir()) == []


def test_importing_the_sdk_needs_only_the_standard_library():
    code = ("import sys; import hai.sdk; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch','pydantic','httpx','fastapi','sqlalchemy')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_should_suspend_follows_the_agents_suspend_file_and_latches(control):
    assert sdk.should_suspend() is False
    assert sdk.should_suspend() is False
    (control / "suspend").write_text(json.dumps({"requested_at": 1.0, "grace_s": 60}))
    assert sdk.suspend_requested() is True
    assert sdk.should_suspend() is True
    (control / "suspend").unlink()
    assert sdk.should_suspend() is True  # once asked, the job goes on suspending


def test_should_suspend_every_n_calls(control):
    assert sdk.should_suspend(every=3) is False  # call 1: checked, no request yet
    (control / "suspend").write_text("{}")
    assert sdk.should_suspend(every=3) is False  # call 2: not checked
    assert sdk.should_suspend(every=3) is False  # call 3: not checked
    assert sdk.should_suspend(every=3) is True  # call 4: checked


def test_report_checkpoint_and_suspend_ready_write_events(control, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "3")
    with sdk.checkpointing():
        ck = tmp_path / "ckpt.pt"
        ck.write_bytes(b"x")
        sdk.report_checkpoint(str(ck), step=42)
    sdk.suspend_ready()
    evs = _events(control, rank=3)
    assert [e["type"] for e in evs] == ["checkpoint", "suspend_ready"]
    assert evs[0]["path"] == str(ck) and evs[0]["step"] == 42 and evs[0]["rank"] == 3
    assert evs[0]["duration_s"] is not None and evs[0]["duration_s"] >= 0
    assert evs[0]["at"] <= evs[1]["at"]


def test_report_checkpoint_makes_relative_paths_absolute(control, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sdk.report_checkpoint("rel/ck.pt", step=1, duration_s=1.5)
    ev = _events(control)[0]
    assert ev["path"] == str(tmp_path / "rel" / "ck.pt") and ev["duration_s"] == 1.5


def test_report_progress_is_rate_limited_and_the_last_one_is_flushed(control, monkeypatch):
    monkeypatch.setenv("HAI_PROGRESS_INTERVAL_S", "3600")
    for step in range(1, 101):
        sdk.report_progress(step, 1000, loss=1.0 / step)
    evs = _events(control)
    assert len(evs) == 1 and evs[0]["step"] == 1  # the first write, then nothing for an hour
    core._flush_progress()  # at exit
    evs = _events(control)
    assert len(evs) == 2 and evs[-1]["step"] == 100 and evs[-1]["metrics"]["loss"] == pytest.approx(0.01)
    sdk.report_progress(1000, 1000)  # the end is always written
    assert _events(control)[-1]["step"] == 1000


def test_resume_path_and_checkpoint_dir_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HAI_RESUME_FROM", "/ck/ckpt-1.pt")
    monkeypatch.setenv("HAI_CHECKPOINT_DIR", str(tmp_path))
    assert sdk.resume_path() == "/ck/ckpt-1.pt"
    assert sdk.checkpoint_dir() == str(tmp_path)


def test_events_from_concurrent_processes_do_not_interleave(control):
    code = ("import hai.sdk as s\n"
            "for i in range(300): s.report_checkpoint('/p/' + 'x' * 200, step=i, duration_s=0.1)\n")
    env = {**os.environ, "HAI_CONTROL_DIR": str(control), "RANK": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    evs = _events(control)  # json.loads of every line: no torn lines
    assert len(evs) == 900
