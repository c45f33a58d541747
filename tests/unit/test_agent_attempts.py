"""The agent's state folder (hai.agent.attempts): records, tombstones, recovery."""

from __future__ import annotations

import json
import subprocess

from hai.agent.attempts import AttemptStore, Rank, reattach
from hai.agent.procs import is_alive, start_ticks
from hai.agent.testing import assignment, wait_for
from hai.protocol import DesiredAction, StopCause


def _attempt(store: AttemptStore, job_id: int = 1):
    a = assignment(job_id, ["true"], attempt=1)
    return store.new(job_id=a.job_id, attempt=a.attempt, spec=a.spec, now=100.0, assigned=DesiredAction.RUN)


def test_a_record_survives_a_restart_with_its_stop_cause(tmp_path):
    store = AttemptStore(tmp_path)
    att = _attempt(store)
    att.ranks = [Rank(rank=0, local_rank=0, gpus=[0], ended=True, exit_code=143)]
    att.stop_cause, att.stopped_reason, att.term_sent_at = StopCause.SUSPEND, "stopped after suspend_ready()", 5.0
    store.save(att)
    (back,) = AttemptStore(tmp_path).load()
    assert back.key == (1, 1) and back.stop_cause is StopCause.SUSPEND and back.stopping
    assert back.ranks[0].exit_code == 143 and back.spec == att.spec


def test_a_folder_without_a_record_is_removed_on_load(tmp_path):
    store = AttemptStore(tmp_path)
    att = _attempt(store)  # the agent died before the record was written
    assert store.load() == [] and not att.dir.exists()


def test_forgetting_leaves_a_tombstone_and_no_folder(tmp_path):
    store = AttemptStore(tmp_path)
    att = _attempt(store, job_id=7)
    att.finished = True
    store.save(att)
    store.forget(att)
    assert not att.dir.exists()
    assert store.read_tombstone((7, 1)).finished and store.read_tombstone((7, 2)) is None
    store.prune_tombstones(now=10**12)  # far beyond the TTL
    assert store.read_tombstone((7, 1)) is None


def test_the_suspend_request_is_a_control_file_the_sdk_reads(tmp_path):
    store = AttemptStore(tmp_path)
    att = _attempt(store)
    store.request_suspend(att, at=123.0)
    assert json.loads((att.control_dir / "suspend").read_text())["requested_at"] == 123.0
    store.cancel_suspend(att)
    assert not (att.control_dir / "suspend").exists() and att.suspend_requested_at is None


def test_reattach_finds_live_ranks_and_takes_a_recorded_exit_as_the_end(tmp_path):
    store = AttemptStore(tmp_path)
    att = _attempt(store)
    live = subprocess.Popen(["sleep", "60"], start_new_session=True)
    sweeping = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its wrapper is still sweeping up
    try:
        att.ranks = [Rank(rank=0, local_rank=0, gpus=[0], pid=live.pid, start_ticks=start_ticks(live.pid)),
                     Rank(rank=1, local_rank=1, gpus=[1], pid=sweeping.pid, start_ticks=start_ticks(sweeping.pid))]
        att.rank_path(1, "exit").write_text(json.dumps({"exit_code": 7}))
        reattach(att, now=200.0)
        assert not att.ranks[0].ended and att.ranks[1].ended and att.ranks[1].exit_code == 7
        assert not att.finished and att.attached_at == 200.0
        wait_for(lambda: sweeping.poll() is not None, what="the swept rank's group to be gone")
        assert is_alive(live.pid, att.ranks[0].start_ticks)
    finally:
        for p in (live, sweeping):
            p.kill()
            p.wait()


def test_reattach_without_processes_marks_the_attempt_finished(tmp_path):
    store = AttemptStore(tmp_path)
    att = _attempt(store)
    att.ranks = [Rank(rank=0, local_rank=0, gpus=[0])]  # spawned, but no pid was ever recorded
    att.rank_path(0, "exit").write_text(json.dumps({"exit_code": 0}))
    reattach(att, now=300.0)
    assert att.finished and att.finished_at == 300.0 and att.ranks[0].exit_code == 0 and att.launch_error is None
