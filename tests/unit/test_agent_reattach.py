"""An agent that dies and comes back reattaches to its ranks: the job keeps running, its exit is
picked up (also when it ended while the agent was down), no second launch, no orphan."""

from __future__ import annotations

import json
import signal
import sys
import textwrap

import pytest

from hai.agent.gpu import FakeGpus
from hai.agent.logs import LogBuffer
from hai.agent.node import NodeAgent
from hai.agent.procs import group_members, is_alive
from hai.agent.testing import assignment, wait_for

PY = sys.executable


def _agent(state, buf=None):
    return NodeAgent(node="n1", state_dir=state, gpus=FakeGpus(2, node="n1"), log_buffer=buf if buf is not None else LogBuffer(),
                     kill_grace_s=2.0)


@pytest.fixture
def job(tmp_path):
    go = tmp_path / "go"
    started = tmp_path / "started"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import os, pathlib, sys, time
        print("before 1"); print("before 2")
        pathlib.Path({str(started)!r}).write_text(str(os.getpid()))
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.02)
        print("after")
        sys.exit(7)
    """))
    return script, started, go


def _status(node, job_id=1, attempt=0):
    return next(s for s in node.statuses() if (s.job_id, s.attempt) == (job_id, attempt))


def test_a_restarted_agent_reattaches_picks_up_the_exit_and_never_launches_twice(tmp_path, job):
    script, started, go = job
    state = tmp_path / "state"
    buf_a = LogBuffer()
    a = _agent(state, buf_a)
    spec = assignment(1, [PY, str(script)], job_type="torch", gpus=[1])
    a.apply([spec])
    wait_for(started.exists, step=a.tick, what="job start")
    wait_for(lambda: len(buf_a) >= 2, step=a.tail_logs, what="first lines")
    first = buf_a.take(10, 1 << 20, 0)
    assert [(ln.seq, ln.line) for ln in first] == [(0, "before 1"), (1, "before 2")]
    a.shipped(first)  # the shipper delivered them
    wrapper = a.attempts[(1, 0)].ranks[0].pid
    job_pid = int(started.read_text())
    del a  # the agent dies (nothing is stopped)

    buf_b = LogBuffer()
    b = _agent(state, buf_b)
    hello = b.recover()
    assert [(s.job_id, s.attempt) for s in hello] == [(1, 0)]
    (rank,) = hello[0].ranks
    assert (rank.rank, rank.pid, rank.state) == (0, wrapper, "running") and not hello[0].finished
    assert b.busy_gpus() == {1: 1}
    for _ in range(3):  # the server still says run: replay-safe, no second launch
        b.apply([spec])
        b.tick()
    assert b.launches == 0 and group_members(wrapper) != [] and is_alive(job_pid, None)

    go.touch()
    wait_for(lambda: _status(b).finished, step=b.tick, what="exit picked up")
    st = _status(b)
    assert [(r.state, r.exit_code) for r in st.ranks] == [("exited", 7)]
    wait_for(lambda: b.attempts[(1, 0)].drained, step=b.tail_logs, what="tail drained")
    after = buf_b.take(10, 1 << 20, 0)
    assert [(ln.seq, ln.line) for ln in after] == [(2, "after")]  # continues the sequence
    assert group_members(wrapper) == []


def test_an_exit_while_the_agent_was_down_is_reported_after_the_restart(tmp_path, job):
    script, started, go = job
    state = tmp_path / "state"
    a = _agent(state)
    a.apply([assignment(1, [PY, str(script)])])
    wait_for(started.exists, step=a.tick, what="job start")
    exit_file = a.attempts[(1, 0)].rank_path(0, "exit")
    del a
    go.touch()
    wait_for(exit_file.exists, what="the rank to end while no agent watches")
    b = _agent(state)
    (st,) = b.recover()
    assert st.finished and st.ranks[0].exit_code == 7 and st.ranks[0].state == "exited"
    b.apply([assignment(1, [PY, str(script)])])
    assert b.launches == 0


def test_a_restarted_agent_can_still_stop_the_job_no_orphan(tmp_path):
    state = tmp_path / "state"
    ready = tmp_path / "ready"
    script = tmp_path / "stubborn.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pathlib.Path({str(ready)!r}).write_text(str(c.pid))
        time.sleep(600)
    """))
    a = _agent(state)
    a.apply([assignment(1, [PY, str(script)], stop_grace_s=0.5)])
    wait_for(ready.exists, step=a.tick, what="job start")
    wrapper = a.attempts[(1, 0)].ranks[0].pid
    del a
    b = _agent(state)
    b.recover()
    b.apply([])  # the server no longer assigns it
    wait_for(lambda: _status(b).finished, step=b.tick, what="stop after restart")
    st = _status(b)
    assert st.stop_cause == "unassigned" and st.ranks[0].exit_code == 128 + signal.SIGKILL
    assert group_members(wrapper) == [] and not is_alive(int(ready.read_text()), None)


def test_a_crash_between_spawn_and_record_is_recovered_from_the_wrappers_pid_file(tmp_path, job):
    script, started, go = job
    state = tmp_path / "state"
    a = _agent(state)
    a.apply([assignment(1, [PY, str(script)])])
    wait_for(started.exists, step=a.tick, what="job start")
    att = a.attempts[(1, 0)]
    pid = att.ranks[0].pid
    record = json.loads((att.dir / "attempt.json").read_text())
    record["ranks"][0]["pid"] = None  # as if the agent died before writing it
    record["ranks"][0]["start_ticks"] = None
    (att.dir / "attempt.json").write_text(json.dumps(record))
    del a, att
    b = _agent(state)
    (st,) = b.recover()
    assert st.ranks[0].pid == pid and st.ranks[0].state == "running" and st.launch_error is None
    go.touch()
    wait_for(lambda: _status(b).finished, step=b.tick, what="exit")
    assert _status(b).ranks[0].exit_code == 7


def test_a_suspend_in_progress_survives_an_agent_restart(tmp_path):
    state = tmp_path / "state"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import time
        from hai import sdk
        while not sdk.should_suspend():
            time.sleep(0.02)
        sdk.report_checkpoint("/ck/x.pt", step=5, duration_s=0.1)
        time.sleep(0.5)
        sdk.suspend_ready()
        time.sleep(600)  # the agent stops it
    """))
    a = _agent(state)
    a.apply([assignment(1, [PY, str(script)])])
    wait_for(lambda: a.busy_gpus(), step=a.tick, what="start")
    a.apply([assignment(1, [PY, str(script)], action="suspend", suspend_grace_s=60)])
    assert _status(a).suspend_requested_at is not None
    del a
    b = _agent(state)
    b.recover()
    b.apply([assignment(1, [PY, str(script)], action="suspend", suspend_grace_s=60)])
    wait_for(lambda: _status(b).finished, step=b.tick, what="suspended")
    st = _status(b)
    assert st.suspend_ready and st.stop_cause == "suspend" and st.checkpoint.step == 5
    assert st.checkpoint.path == "/ck/x.pt"


def test_lines_read_but_not_shipped_when_the_agent_died_are_shipped_after_its_restart(tmp_path, job):
    """The agent is killed with lines in its buffer (read from the rank's files, the offsets past
    them saved): after the restart they are offered again under their seqs (the server keeps one
    copy of each seq), then the job's later lines continue the sequence."""
    script, started, go = job
    state = tmp_path / "state"
    buf_a = LogBuffer()
    a = _agent(state, buf_a)
    a.apply([assignment(1, [PY, str(script)], job_type="torch", gpus=[1])])
    wait_for(started.exists, step=a.tick, what="job start")
    wait_for(lambda: len(buf_a) >= 2, step=a.tail_logs, what="first lines")
    taken = buf_a.take(10, 1 << 20, 0)
    a.shipped(taken[:1])  # "before 1" reached the server; "before 2" was on its way
    del a  # killed

    buf_b = LogBuffer()
    b = _agent(state, buf_b)
    b.recover()
    again = buf_b.take(10, 1 << 20, 0)
    assert [(ln.seq, ln.stream, ln.line) for ln in again] == [(1, "stdout", "before 2")]
    go.touch()
    wait_for(lambda: _status(b).finished, step=b.tick, what="exit picked up")
    wait_for(lambda: b.attempts[(1, 0)].drained, step=b.tail_logs, what="tail drained")
    assert [(ln.seq, ln.line) for ln in buf_b.take(10, 1 << 20, 0)] == [(2, "after")]
