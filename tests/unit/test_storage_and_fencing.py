"""Issue 13, node side: a full filesystem reaches the job as the SDK's StorageFull (and the
agent as an event it reports); a rank whose agent lease ran out stops itself (rankwrap --lease).
Real files and processes: /dev/full gives a real ENOSPC."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from hai import sdk
from hai.agent.attempts import _apply_event
from hai.agent.launcher import RANKWRAP
from hai.agent.main import fence_lease
from hai.sdk import core


@pytest.fixture
def control(tmp_path, monkeypatch):
    d = tmp_path / "control"
    d.mkdir()
    monkeypatch.setenv("HAI_CONTROL_DIR", str(d))
    core._reset()
    yield d
    core._reset()


def test_a_full_filesystem_is_a_storage_full_the_job_can_handle_and_the_agent_is_told(control):
    with pytest.raises(sdk.StorageFull) as err:
        with sdk.storage("/dev/full"), open("/dev/full", "w") as f:
            f.write("x" * 10)
            f.flush()
    assert isinstance(err.value, OSError) and "no space left to write /dev/full" in str(err.value)
    events = [json.loads(line) for line in (control / "events.0.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events] == ["storage_full"] and events[0]["path"] == "/dev/full"


def test_other_errors_go_through_unchanged(control, tmp_path):
    with pytest.raises(FileNotFoundError):
        with sdk.storage(str(tmp_path / "nope" / "x")):
            open(tmp_path / "nope" / "x", "w")
    assert not (control / "events.0.jsonl").exists()


def test_the_agent_keeps_each_storage_error_once(tmp_path):
    class Att:
        storage_errors: list[str] = []
    att = Att()
    ev = {"type": "storage_full", "path": "/ck/a", "error": "[Errno 28] No space left on device"}
    assert _apply_event(att, ev, now=time.time()) == (True, False)
    assert _apply_event(att, ev, now=time.time()) == (False, False)  # the same one: not again
    assert att.storage_errors == ["/ck/a: [Errno 28] No space left on device"]


def test_the_lease_runs_out_before_the_server_gives_the_node_away():
    lease = fence_lease(sent_at=1000.0, lost_after_s=30.0)
    assert lease == {"valid_until": 1022.5, "grace_s": 3.75}  # stopped by 1026.25 < 1030
    small = fence_lease(sent_at=0.0, lost_after_s=2.0)
    assert small["valid_until"] + small["grace_s"] < 2.0


def _wrap(tmp_path, lease: dict | None, seconds: float) -> tuple[int, dict, float]:
    lease_path = tmp_path / "lease.json"
    if lease is not None:
        lease_path.write_text(json.dumps(lease))
    exit_path = tmp_path / "exit"
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, "-I", "-S", RANKWRAP, "--exit-file", str(exit_path), "--lease", str(lease_path),
                         "--", sys.executable, "-c", f"import time; time.sleep({seconds})"], timeout=120).returncode
    return rc, json.loads(exit_path.read_text()), time.monotonic() - t0


def test_a_rank_whose_lease_ran_out_stops_itself(tmp_path):
    rc, record, took = _wrap(tmp_path, {"valid_until": time.time() - 1, "grace_s": 0.5}, seconds=60)
    assert record["fenced"] is True and record["exit_code"] == rc == 128 + 15  # SIGTERM
    assert took < 30


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    lease_path = tmp_path / "lease.json"
    ready = tmp_path / "ready"
    code = (f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').close(); "
            "time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-I", "-S", RANKWRAP, "--exit-file", str(tmp_path / "exit"), "--lease",
                          str(lease_path), "--", sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:  # the rank ignores SIGTERM from now on
        time.sleep(0.05)
    lease_path.write_text(json.dumps({"valid_until": time.time() - 1, "grace_s": 0.3}))
    rc = p.wait(timeout=120)
    record = json.loads((tmp_path / "exit").read_text())
    assert record["fenced"] is True and rc == 128 + 9


def test_a_valid_lease_or_none_leaves_the_rank_alone(tmp_path):
    rc, record, _ = _wrap(tmp_path, {"valid_until": time.time() + 600, "grace_s": 1}, seconds=0.5)
    assert rc == 0 and "fenced" not in record
    (tmp_path / "lease.json").unlink()
    rc, record, _ = _wrap(tmp_path, None, seconds=0.3)  # no lease: a server that sends none
    assert rc == 0 and "fenced" not in record


def test_an_attempt_whose_ranks_fenced_themselves_reports_the_fenced_cause(tmp_path):
    """The agent names it (StopCause.FENCED): the server then requeues the job instead of
    failing it for the SIGTERM exit code (domain.outcomes: the fenced rule)."""
    from hai.agent.gpu import FakeGpus
    from hai.agent.node import NodeAgent
    from hai.agent.testing import assignment, wait_for
    from hai.protocol import StopCause

    node = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(2, node="n1"), kill_grace_s=1.0)
    try:
        node.renew_lease(valid_until=time.time() - 1, grace_s=0.3)  # the agent has been cut off since
        node.apply([assignment(1, [sys.executable, "-c", "import time; time.sleep(60)"], job_type="torch", gpus=[0, 1])])
        st = wait_for(lambda: next((s for s in node.statuses() if s.finished), None), timeout=30, step=node.tick,
                      what="the fenced attempt to finish")
        assert st.stop_cause == StopCause.FENCED and "lease" in st.stopped_reason
        assert [r.exit_code for r in st.ranks] == [143, 143]
    finally:
        node.stop_all()


# ---------------------------------------------------------------- a full log folder (issue 13)
# /dev/full answers every write with ENOSPC: the rank's log file, the SDK's events file or the
# agent's temporary files pointed at it stand for a full state folder.


def test_a_rank_whose_log_file_is_full_keeps_running_and_its_exit_is_recorded(tmp_path):
    """Before: the job's print() raised OSError (ENOSPC) and the rank died with exit code 1.
    Now the wrapper takes the output and drops what cannot be written."""
    code = "import sys\nfor i in range(2000):\n    print('line', i, 'x' * 100)\nprint('done', file=sys.stderr)\n"
    with open("/dev/full", "wb") as full:
        rc = subprocess.run([sys.executable, "-I", "-S", RANKWRAP, "--exit-file", str(tmp_path / "exit"), "--",
                             sys.executable, "-c", code], stdout=full, stderr=full, timeout=120).returncode
    assert rc == 0
    assert json.loads((tmp_path / "exit").read_text())["exit_code"] == 0
    assert not (tmp_path / "exit.reserve").exists()  # given back once the record is written


def test_output_dropped_on_a_full_log_file_is_announced_once_it_takes_writes_again(tmp_path):
    import os

    from hai.agent import rankwrap

    log = tmp_path / "rank.stdout"
    full = os.open("/dev/full", os.O_WRONLY)
    ok = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        sink = rankwrap.Sink(full)
        sink.write(b"one\ntwo\n")
        sink.write(b"three\nfour")  # a cut line counts as one
        assert (sink.dropped_lines, sink.dropped_bytes) == (4, 18)
        sink.fd = ok  # room again
        sink.write(b"five\n")
    finally:
        os.close(full)
        os.close(ok)
    assert log.read_text().splitlines() == [
        "[hai] 4 lines of output dropped (18 bytes): the log folder was full (No space left on device)", "five"]


def test_a_checkpoint_the_platform_could_not_be_told_of_is_a_storage_full(control):
    """The SDK's events file is in the (full) state folder: report_checkpoint raises StorageFull
    (the platform does not know that checkpoint: the job must), a progress report is dropped."""
    (control / "events.0.jsonl").symlink_to("/dev/full")
    with pytest.raises(sdk.StorageFull) as err:
        sdk.report_checkpoint("/ck/step-10", 10)
    assert "no space left to tell the platform (checkpoint)" in str(err.value)
    sdk.report_progress(5, 10, loss=1.0)  # no error: progress is best effort


def test_the_agent_renews_its_lease_and_keeps_its_records_in_memory_on_a_full_folder(tmp_path):
    import os

    from hai.agent.gpu import FakeGpus
    from hai.agent.node import LEASE_BYTES, NodeAgent
    from hai.agent.testing import assignment, wait_for

    node = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(1, node="n1"), kill_grace_s=1.0)
    try:
        node.renew_lease(valid_until=time.time() + 60, grace_s=0.3)
        node.apply([assignment(1, [sys.executable, "-c", "import time; time.sleep(60)"], gpus=[0])])
        att = next(iter(node.attempts.values()))
        # the folder fills: every new file the agent writes fails with ENOSPC
        (node.lease_path.with_name(f"lease.json.tmp{os.getpid()}")).symlink_to("/dev/full")
        (att.dir / "attempt.json.tmp").symlink_to("/dev/full")
        node.renew_lease(valid_until=time.time() + 600, grace_s=0.5)  # overwritten in place
        lease = json.loads(node.lease_path.read_text())
        assert lease["valid_until"] > time.time() + 500 and node.lease_path.stat().st_size == LEASE_BYTES
        assert node.store.save(att) is False  # the record stays in memory, no exception
        assert not (att.dir / "attempt.json.tmp").exists()  # nothing half-written left behind
        (att.dir / "attempt.json.tmp").symlink_to("/dev/full")
        with pytest.raises(OSError):
            node.store.save(att, required=True)  # a launch: no process without its record
        assert node.check_storage(time.time()) is True
        st = node.statuses()[0]
        assert st.storage_errors and "is full (No space left on device)" in st.storage_errors[0]
        assert "the job keeps running" in st.storage_errors[0]
        assert [r.state for r in st.ranks] == ["running"]
        assert not (att.dir / "attempt.json.tmp").exists()  # room again: the next check finds none
        wait_for(lambda: node.storage_error is None, timeout=10, step=lambda: node.check_storage(time.time() + 10),
                 what="the folder to have room")
    finally:
        node.stop_all()
        for _ in range(50):
            node.tick()
            if not node.running():
                break
            time.sleep(0.1)
