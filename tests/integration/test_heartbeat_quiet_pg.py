"""Issue 12 (the fan-in's fourth pass): a full heartbeat that changes nothing but the node's liveness runs in
Core (``services.agents._quiet_heartbeat``: one statement reads the node, its pending-run flag and
its active allocations with their jobs; one UPDATE writes liveness; a quick round that falls due is
one INSERT more), and everything else goes the ORM way as before. On PostgreSQL, the same cluster is driven through the same heartbeats twice,
with the quiet pass and without it: the replies and everything written (jobs, their events,
allocations, GPU holds, nodes, validation runs) must be the same, while the quiet pass answered
the heartbeats that changed nothing (or asked for a quick round) and none of the others: a round's
report, a changed report, an unreported stop released, a draining node."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from hai.db.migrate import upgrade
from hai.db.models import GpuHold, Job, JobAllocation, Node, ValidationRun
from hai.protocol import AttemptStatus, GpuMetrics, Heartbeat, RankStatus
from hai.services import agents, auth, node_health
from hai.services import jobs as job_service
from hai.services.context import Platform
from hai.settings import Settings
from tests.api.test_heartbeat_batch import NODES, cluster
from tests.integration.conftest import pg_url, second_pg_url, server_db_url  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

EVERY = 3  # quick rounds every 3 heartbeats: several fall due within the drive


def platform(tmp: Path, url: str) -> Platform:
    upgrade(url)
    return Platform.from_settings(Settings(data_dir=tmp, frontend_dist=tmp / "none", db={"url": url},
                                           validation={"quick_every_heartbeats": EVERY}))


def running(job_id: int, attempt: int, rank: int = 0) -> AttemptStatus:
    return AttemptStatus(job_id=job_id, attempt=attempt, ranks=[RankStatus(rank=rank, local_rank=0, pid=7)])


def exited(job_id: int, attempt: int, rank: int = 0) -> AttemptStatus:
    return AttemptStatus(job_id=job_id, attempt=attempt, finished=True,
                         ranks=[RankStatus(rank=rank, local_rank=0, state="exited", exit_code=0)])


def passed(run: dict, kind: str = "pass") -> dict:
    """A finished run's report: passed (a critical check passed, one not critical failed, one
    skipped), or ``fail`` (a critical check failed), or ``xid`` (passed, with a hardware Xid)."""
    lv = run["level"]
    checks = [{"name": "gpu_inventory", "level": lv, "critical": True, "status": "failed" if kind == "fail" else "passed",
               "value": 7 if kind == "fail" else 8, "threshold": 8, "detail": "GPUs as registered", "duration_s": 0.25},
              {"name": "gpu_xid", "level": lv, "critical": False, "status": "failed" if kind == "xid" else "passed",
               "value": 1 if kind == "xid" else 0, "threshold": 0, "unit": "errors",
               "data": {"hardware": [79]} if kind == "xid" else {"seen": []}},
              {"name": "nccl_bus", "level": lv, "critical": False, "status": "skipped", "detail": "quick round"}]
    return {"run_id": run["run_id"], "level": lv, "started_at": 1.0 + run["run_id"], "finished_at": 2.5 + run["run_id"],
            "checks": checks}


def drive(p: Platform, jobs: dict, rounds: int = 12) -> tuple[list[dict], list[tuple[tuple[str, bool], bool]]]:
    """Every node heartbeats ``rounds`` times, echoing its digest, answering the validation runs it
    is asked for, reporting its attempts running; then: "late" is cancelled (round 4: the agent
    stops it and forgets it, round 5: an unreported stop to release), a node of "two" is drained
    (round 6), "one" exits (round 8); one node of "two" answers its runs only every third round;
    from round 9 "one"'s node reports a hardware Xid in its runs and "late"'s node a failed
    critical check (``passed``: every other report passes).
    Returns the replies and ((node, answered quietly), delivered validation results) per beat."""
    admin = auth.Principal(kind="user", user_id=None, name="admin", group="g", is_admin=True)
    (one_node, one), = jobs["one"].items()
    (late_node, late), = jobs["late"].items()
    two_nodes = sorted(jobs["two"])
    two = jobs["two"][two_nodes[0]]
    slow = two_nodes[0]
    digests: dict[str, str | None] = {}
    asked: dict[str, list[dict]] = {}
    replies, paths, delivered = [], [], []
    real = agents._quiet_heartbeat

    def spy(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        reply = real(*a, **kw)
        paths.append((a[1].node, reply is not None))
        return reply

    for r in range(rounds):
        if r == 4:
            with p.sessions() as s:
                job_service.cancel_job(session=s, job_id=late[0], user=admin)
        if r == 6:
            with p.sessions() as s:
                node_health.drain_node(session=s, name=two_nodes[1], reason="test", user=admin)
        for n in NODES:
            if n == late_node:
                attempts = [running(*late)] if r < 5 else []  # stopped and forgotten from round 5
            elif n == one_node:
                attempts = [running(*one)] if r < 8 else [exited(*one)]
            else:
                attempts = [running(*two, rank=two_nodes.index(n))]
            # the slow node runs its validators for three heartbeats (its replies list the run meanwhile)
            answer = asked.pop(n, []) if n != slow or r % 3 == 2 else []
            kind = "pass" if r < 9 else {one_node: "xid", late_node: "fail"}.get(n, "pass")
            hb = Heartbeat(node=n, attempts=attempts, assignments_digest=digests.get(n), protocol_version=1,
                           validations=[passed(v, kind) for v in answer],
                           gpus=[GpuMetrics(index=0, uuid=f"GPU-{n}-0", util_pct=float(r))])
            before = len(paths)
            agents._quiet_heartbeat = spy
            try:
                with p.sessions() as s:
                    reply = agents.heartbeat(session=s, hb=hb, settings=p.settings)
            finally:
                agents._quiet_heartbeat = real
            if len(paths) == before:
                paths.append((n, False))  # not offered to the quiet pass (it delivered validations)
            delivered.append(kind if answer else "")
            digests[n] = reply.assignments_digest
            asked[n] = [v.model_dump(mode="json") for v in reply.validations]
            replies.append(reply.model_dump(mode="json"))
    return replies, list(zip(paths, delivered))


def state(p: Platform) -> dict:
    with p.sessions() as s:
        return {
            "jobs": [(j.name, j.state, j.exit_code, j.attempt, j.desired_action,
                      [(e.from_state, e.to_state, e.reason) for e in sorted(j.events, key=lambda e: e.id)])
                     for j in s.scalars(select(Job).order_by(Job.id))],
            "allocations": [(a.job_id, a.node_name, a.active, a.status)
                            for a in s.scalars(select(JobAllocation).order_by(JobAllocation.id))],
            "holds": s.scalar(select(func.count()).select_from(GpuHold)),
            "nodes": [(n.name, n.state, n.heartbeats_since_quick, n.gpu_metrics, n.gpu_util_pct, n.gpus_busy,
                       n.last_heartbeat_at is not None) for n in s.scalars(select(Node).order_by(Node.name))],
            "runs": [(v.node_name, v.level, v.trigger, v.status, v.delivered_at is not None, v.summary, v.started_at,
                      v.finished_at, [(c.position, c.name, c.level, c.critical, c.status, c.value, c.threshold, c.unit,
                                       c.detail, c.duration_s, c.data) for c in v.checks])
                     for v in s.scalars(select(ValidationRun).order_by(ValidationRun.id))],
        }


def test_the_quiet_pass_answers_what_changes_nothing_and_writes_what_the_orm_pass_writes(
        pg_url, second_pg_url, tmp_path: Path, monkeypatch):  # noqa: F811
    quiet, orm = platform(tmp_path / "q", pg_url), platform(tmp_path / "o", second_pg_url)
    try:
        jobs = cluster(quiet)
        assert cluster(orm) == jobs
        got, paths = drive(quiet, jobs)
        monkeypatch.setattr(agents, "_quiet_heartbeat", lambda *a, **kw: None)  # every beat the ORM way
        want, _ = drive(orm, jobs)
        monkeypatch.undo()
        assert got == want
        written = state(quiet)
        assert written == state(orm)
    finally:
        quiet.close()
        orm.close()
    # what changed something went the ORM way; what did not, the quiet way
    beats = paths
    paths = [b[0] for b in beats]
    by_round = [paths[i:i + len(NODES)] for i in range(0, len(paths), len(NODES))]
    quietly = sum(q for _, q in paths)
    assert 0 < quietly < len(paths)
    (one_node, _), = jobs["one"].items()
    (late_node, _), = jobs["late"].items()
    drained = sorted(jobs["two"])[1]
    assert dict(by_round[0])[one_node] is False  # the first report of a started attempt: stored
    assert dict(by_round[5])[late_node] is False  # the unreported stop released
    assert dict(by_round[8])[one_node] is False  # the exit
    assert not any(q for n, q in paths[6 * len(NODES):] if n == drained)  # draining, then the job moved
    # results that failed or carry a hardware Xid are never absorbed quietly; in rounds 1-3 (before
    # the cancel) every beat is quiet: those that deliver passed runs, those that ask for a round,
    # and the slow node's while its run waits
    asked_quietly = waiting_quietly = passed_quietly = 0
    for i, (reply, ((node, q), delivered)) in enumerate(zip(got, beats)):
        if delivered in ("fail", "xid"):
            assert not q, f"beat {i} of {node}: {delivered} results absorbed quietly"
        elif 1 <= i // len(NODES) <= 3:
            assert q, f"beat {i} of {node}: changed nothing but liveness (or delivered a passed run), went the ORM way"
            asked_quietly += bool(reply["validations"])
            passed_quietly += delivered == "pass"
        if not delivered and q and reply["validations"] and i >= len(NODES) and got[i - len(NODES)]["validations"]:
            waiting_quietly += 1  # listed again, quietly, while the agent runs it
    assert asked_quietly >= 2  # quick rounds fell due in rounds 1-3 and were asked for quietly
    assert passed_quietly >= 2  # ... and their passed results were stored quietly
    assert {"fail", "xid"} <= {d for _, d in beats}  # both went the ORM way (asserted above) and wrote the same
    nodes = {n[0]: n[1] for n in written["nodes"]}
    assert nodes[late_node] == "unhealthy"  # the failed critical check
    assert any(r[0] == one_node and r[2] == "xid" for r in written["runs"])  # the Xid asked for a full run
    summaries = {r[5] for r in written["runs"] if r[3] == "passed"}
    assert "2 passed, 0 failed (not critical), 1 skipped" in summaries  # the quiet pass's summary
    assert all(len(r[8]) == 3 for r in written["runs"] if r[3] in ("passed", "failed"))  # and its checks
    assert waiting_quietly >= 1
