"""Faults on a whole cluster of real processes (issue 13): API server, scheduler, Celery worker
with beat, fake-GPU agents, job processes, on a PostgreSQL and a Redis of the test's own. The
invariant monitor (monitor.py) reads the database throughout; each test ends with its checks."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from tests.faults.cluster import wait_for
from tests.faults.crashloop import run_crash_loop

# whole clusters on a loaded VM: generous limits (each test synchronises on conditions)
pytestmark = pytest.mark.timeout(600)

FAST = {"HAI_AGENT__LOST_AFTER_S": "12", "HAI_AGENT__HEARTBEAT_INTERVAL_S": "0.5"}


def _running_everywhere(cluster, ids):
    """Every job's rank 0 has started (its first mark) and is alive; returns {job: start mark}."""
    def ok():
        got = {}
        for jid in ids:
            alive = cluster.rank0_running(jid)
            if len(alive) != 1:
                return None
            got[jid] = alive[0]
        return got
    return wait_for(ok, timeout=180, interval=0.3, what="every job's rank 0 to run")


def _starts(cluster, jid):
    return [m for m in cluster.read_marks() if m["job"] == jid and m["ev"] == "start"]


def _end(cluster, monitor):
    report = monitor.final(accepted=cluster.accepted, expected_exit=cluster.expected_exit, marks=cluster.read_marks())
    report.assert_ok()
    return report


def test_agent_kill9_and_restart_reattaches_every_rank(make_cluster, monitor_for):
    # lost_after_s stays 30 s: a restart on this loaded VM can take longer than a short one
    cluster = make_cluster(settings={**FAST, "HAI_AGENT__LOST_AFTER_S": "30"}, nodes=[("n0", 4), ("n1", 4), ("n2", 4)])
    monitor = monitor_for(cluster)
    ids = [cluster.submit(seconds=15, nodes=2, gpus_per_node=4, name="two-node")]
    ids += [cluster.submit(seconds=15, gpus_per_node=2, name=f"long{i}") for i in range(2)]
    before = _running_everywhere(cluster, ids)
    ranks_before = {(m["job"], m["rank"], m["pid"]) for m in cluster.read_marks() if m["ev"] == "start"}
    assert len(ranks_before) == 4  # rank 0 and 1 of the two-node job, and the two others
    for agent in cluster.agents.values():  # every agent: kill -9, start again
        agent.kill9()
        agent.start()
    done = cluster.wait_terminal(ids, timeout=240)
    assert all(j["state"] == "succeeded" for j in done.values()), done
    # every rank that ran before the kill is the one that finished: reattached, none relaunched
    starts = [m for m in cluster.read_marks() if m["ev"] == "start"]
    assert {(m["job"], m["rank"], m["pid"]) for m in starts} == ranks_before
    finished = {(m["job"], m["rank"], m["pid"]) for m in cluster.read_marks() if m["ev"] == "stop" and m["why"] == "done"}
    assert finished == ranks_before
    assert all(j["attempt"] == 1 and j["restarts"] == 0 for j in done.values()), done
    assert {m["node"] for m in before.values()} | {m["node"] for m in starts} == set(cluster.agents)
    _end(cluster, monitor)


def test_short_partition_keeps_jobs_running(make_cluster, monitor_for):
    cluster = make_cluster(settings=FAST)
    monitor = monitor_for(cluster)
    ids = [cluster.submit(seconds=10, gpus_per_node=4, name=f"p{i}") for i in range(2)]
    _running_everywhere(cluster, ids)
    agent = cluster.agents["n0"]
    agent.freeze()  # the agent is cut off: no heartbeat reaches the server
    t_frozen = cluster.read_marks()[-1]["t"]
    # 2.5 s of silence, well inside lost_after_s (12 s) and the agent's lease (9 s; a held long poll, up to 3 s, counts too): measured by
    # the jobs' own ticks, which go on meanwhile
    wait_for(lambda: any(m["ev"] == "tick" and m["t"] > t_frozen + 2.5 for m in cluster.read_marks()),
             timeout=60, what="2.5 s of partition")
    agent.thaw()
    done = cluster.wait_terminal(ids, timeout=180)
    assert all(j["state"] == "succeeded" and j["attempt"] == 1 and j["restarts"] == 0 for j in done.values()), done
    assert all(len(_starts(cluster, jid)) == 1 for jid in ids)
    assert cluster.nodes_state()["n0"] != "lost"
    _end(cluster, monitor)


def test_long_partition_requeues_elsewhere_and_fences_the_old_copy(make_cluster, monitor_for):
    cluster = make_cluster(settings=FAST)
    monitor = monitor_for(cluster)
    jid = cluster.submit(seconds=30, gpus_per_node=4, checkpoint_every=1.0, name="fenced")
    first = _running_everywhere(cluster, [jid])[jid]
    ckpt = wait_for(lambda: cluster.job(jid)["last_checkpoint"], timeout=90, what="a checkpoint to reach the platform")
    victim = cluster.agents[first["node"]]
    other = next(n for n in cluster.agents if n != first["node"])
    victim.freeze()
    # the node is lost, the job requeued and started on the other node...
    wait_for(lambda: cluster.nodes_state()[first["node"]] == "lost", timeout=60, what="the node to be lost")
    wait_for(lambda: any(m["node"] == other for m in _starts(cluster, jid)), timeout=90, what="the job to restart")
    # ...and the copy on the partitioned node stopped itself before that (its lease ran out)
    assert first["pid"] not in [m["pid"] for m in cluster.rank0_running(jid)]
    stops = [m for m in cluster.read_marks() if m["pid"] == first["pid"] and m["ev"] == "stop"]
    assert stops and stops[0]["why"] == "signal 15", stops
    victim.thaw()  # back: the server has it re-register; nothing stale runs there
    done = cluster.wait_terminal([jid], timeout=240)[jid]
    assert done["state"] == "succeeded" and done["attempt"] == 2 and done["restarts"] == 1, done
    assert "lost" in " ".join(e["reason"] for e in done["events"])
    report = _end(cluster, monitor)  # includes: no two copies of rank 0 at once, resumed from the checkpoint
    assert not report.rank0_overlaps
    resumed = [m for m in _starts(cluster, jid) if m["node"] == other][0]
    assert resumed["resume_from"] is not None and resumed["done"] > 0
    assert resumed["resume_from"] >= ckpt["path"]  # the one it had, or a later one it reported


def test_postgres_restart_answers_503_and_loses_nothing(make_cluster, monitor_for, throwaway_services):
    pg, _ = throwaway_services
    cluster = make_cluster(settings={**FAST, "HAI_AGENT__LOST_AFTER_S": "30"})
    monitor = monitor_for(cluster)
    ids = [cluster.submit(seconds=12, gpus_per_node=2, name=f"pg{i}") for i in range(3)]
    _running_everywhere(cluster, ids)
    pg.stop("immediate")
    try:
        with cluster.client() as c:
            r = c.get("/api/v1/jobs")
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("application/json")
            assert "database is unavailable" in r.json()["detail"] and "Traceback" not in r.text
            assert r.headers["retry-after"]
            r = c.post("/api/v1/jobs", json={"name": "x", "command": ["true"]})
            assert r.status_code == 503, r.text
        # the jobs keep running meanwhile (their ticks go on)
        t = cluster.read_marks()[-1]["t"]
        wait_for(lambda: any(m["ev"] == "tick" and m["t"] > t + 3 for m in cluster.read_marks()), timeout=60,
                 what="jobs ticking during the outage")
        assert all(cluster.rank0_running(j) for j in ids)
    finally:
        pg.start()
    later = cluster.submit(seconds=1, name="after")
    done = cluster.wait_terminal([*ids, later], timeout=240)
    assert all(j["state"] == "succeeded" and j["attempt"] == 1 for j in done.values()), done
    assert all(p.alive for p in cluster.server_procs)  # the servers rode it out
    report = _end(cluster, monitor)
    assert report.sample_errors > 0  # the monitor saw the database away, and kept going


def test_redis_outage_falls_back_to_polling(make_cluster, monitor_for, throwaway_services):
    _, rd = throwaway_services
    cluster = make_cluster(settings=FAST)
    monitor = monitor_for(cluster)
    ids = [cluster.submit(seconds=8, gpus_per_node=2, name=f"r{i}") for i in range(2)]
    _running_everywhere(cluster, ids)
    rd.stop()
    try:
        # submissions go on and are scheduled without wake-ups (the scheduler polls)
        during = [cluster.submit(seconds=1, gpus_per_node=1, name=f"during{i}") for i in range(3)]
        done = cluster.wait_terminal(during, timeout=120)
        assert all(j["state"] == "succeeded" for j in done.values()), done
    finally:
        rd.start()
    worker_log = cluster.worker.log
    mark = len(worker_log.read_text(errors="replace"))
    after = cluster.submit(seconds=1, name="after")
    done = cluster.wait_terminal([*ids, after], timeout=180)
    assert all(j["state"] == "succeeded" for j in done.values()), done
    # Celery's periodic work resumes: beat's reaper runs again through the restarted broker
    wait_for(lambda: "hai.tasks.reap_lost_nodes" in worker_log.read_text(errors="replace")[mark:] and
             "succeeded" in worker_log.read_text(errors="replace")[mark:], timeout=120,
             what="the reaper task to run again")
    assert cluster.worker.alive
    _end(cluster, monitor)


@pytest.mark.timeout(900)
def test_small_crash_loop_loses_nothing(make_cluster):
    cluster = make_cluster(settings=FAST, servers=2, nodes=[("n0", 4), ("n1", 4), ("n2", 4), ("n3", 4)])
    result = run_crash_loop(cluster, jobs=50, kills=10, seed=13, drain_timeout_s=600, submit_rate_hz=5)
    out = result.as_dict()
    assert out["kills_survived"] == 10
    result.report.assert_ok()
    assert out["final_states"].get("failed", 0) == sum(1 for v in cluster.expected_exit.values() if v)


def test_api_maps_only_unavailability_to_503():
    """A bug in a query stays a 500 (it is not the database being away)."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    from hai.api.errors import database_unavailable

    assert database_unavailable(OperationalError("SELECT 1", {}, Exception("connection refused")))
    assert not database_unavailable(IntegrityError("INSERT", {}, Exception("duplicate key")))


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_full_checkpoint_disk_is_told_to_the_job_and_reported(make_cluster, monitor_for):
    """The checkpoint folder's filesystem fills up mid-run (a small tmpfs, filled by the test):
    the job's next checkpoint raises the SDK's StorageFull, which it handles (goes on without
    it); the agent keeps running; the platform records it as a job event."""
    cluster = make_cluster(settings={**FAST, "HAI_AGENT__LOST_AFTER_S": "30"})
    if os.geteuid() != 0 or not _mount_tmpfs(cluster.checkpoints, "512k"):
        pytest.skip("needs root to mount a small tmpfs (a full filesystem of the test's own)")
    try:
        monitor = monitor_for(cluster)
        jid = cluster.submit(seconds=8, gpus_per_node=1, checkpoint_every=0.5, name="full-disk")
        wait_for(lambda: any(m["job"] == jid and m["ev"] == "ckpt" for m in cluster.read_marks()), timeout=120,
                 what="a first checkpoint")
        try:  # fill the filesystem (the job's checkpoints may have filled it already)
            with open(cluster.checkpoints / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
        done = cluster.wait_terminal([jid], timeout=180)[jid]
        assert done["state"] == "succeeded", done  # it handled the error and finished
        failed = [m for m in cluster.read_marks() if m["job"] == jid and m["ev"] == "ckpt_failed"]
        assert failed and "No space left" in failed[0]["error"]
        notes = [e["reason"] for e in done["events"] if "storage full" in e["reason"]]
        assert notes and "storage full on node" in notes[0] and "No space left" in notes[0], done["events"]
        assert all(a.alive for a in cluster.agents.values())
        _end(cluster, monitor)
    finally:
        subprocess.run(["umount", "-l", str(cluster.checkpoints)], capture_output=True)


def _fill(path) -> None:
    """Write ``path`` until its filesystem is full (ENOSPC)."""
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC


def test_full_log_disk_keeps_the_job_and_the_agent_running_and_is_reported(make_cluster, monitor_for, tmp_path):
    """The agent's state folder (where each rank's stdout/stderr land before they are shipped,
    and the attempt records, the lease, the SDK's control files) fills up mid-run (a small tmpfs
    of the test's own, filled by the test): the job keeps printing and keeps running (its output
    is dropped, not its process), the agent keeps running and heartbeating (its lease too, or the
    ranks would stop themselves), the platform records "storage full on node n0: log folder ..."
    on the job; once there is room again the output flows on behind a marker that says how much
    was dropped, and the job ends by its own exit code on its first attempt."""
    state = tmp_path / "agent-state"
    if os.geteuid() != 0 or not _mount_tmpfs(state, "1m"):
        pytest.skip("needs root to mount a small tmpfs (a full filesystem of the test's own)")
    try:
        # one node: the job runs where the disk fills; lost_after_s 12 s, so a lease the agent
        # could not renew would stop the job well within the time the disk stays full
        cluster = make_cluster(settings=FAST, nodes=[("n0", 4)], agents_root=state)
        monitor = monitor_for(cluster)
        jid = cluster.submit(seconds=25, gpus_per_node=1, chatty=True, name="full-log-disk")
        wait_for(lambda: "tick" in cluster.logs(jid), timeout=120, what="the job's first lines on the platform")
        _fill(state / "filler")
        t_full = cluster.read_marks()[-1]["t"]

        def reported():
            j = cluster.job(jid)
            return j if any("storage full on node n0: log folder" in e["reason"] for e in j["events"]) else None
        job = wait_for(reported, timeout=60, what="the full log folder reported on the job")
        assert job["state"] == "running", job
        # the disk stays full for longer than the agent's lease (9 s): the job goes on ticking,
        # the agent heartbeats, the node is not lost
        wait_for(lambda: any(m["ev"] == "tick" and m["t"] > t_full + 10 for m in cluster.read_marks()),
                 timeout=60, what="10 s of ticks with the log folder full")
        assert len(cluster.rank0_running(jid)) == 1
        assert cluster.agents["n0"].alive
        node = next(n for n in cluster.get("/api/v1/nodes") if n["name"] == "n0")
        assert node["state"] == "ready", node
        os.unlink(state / "filler")  # room again: the output flows on behind the marker
        done = cluster.wait_terminal([jid], timeout=180)[jid]
        assert done["state"] == "succeeded" and done["attempt"] == 1 and done["restarts"] == 0, done
        text = cluster.logs(jid)
        assert "lines of output dropped" in text and "the log folder was full" in text, text[-2000:]
        after = text[text.index("lines of output dropped"):]
        assert "tick" in after  # lines written after the marker reached the platform
        assert cluster.agents["n0"].alive
        _end(cluster, monitor)
    finally:
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
