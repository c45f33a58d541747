"""Issue 14: the Kubernetes backend sends its virtual agents' heartbeats in batches, one
transaction each (``services.agents.heartbeats``). A batch must do and answer exactly what the
same heartbeats do one after the other: the same replies, job states, events, allocation
statuses and GPU holds. Here the same cluster (a single-node job, a two-node job whose nodes
report in the same batch, a node that has not started its job yet, a node the server does not
know) is driven through three rounds of reports, once batched and once one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from hai.db.models import Base, GpuHold, Job, JobAllocation
from hai.protocol import AgentHello, AttemptStatus, GpuInfo, Heartbeat, RankStatus
from hai.schemas.jobs import JobCreate
from hai.services import agents, auth
from hai.services import jobs as job_service
from hai.services.context import Platform
from hai.services.scheduling import run_cycle
from hai.settings import Settings

NODES = ("n0", "n1", "n2", "n3")


def make_platform(tmp: Path, db_url: str | None = None) -> Platform:
    s = Settings(data_dir=tmp, frontend_dist=tmp / "none", **({"db": {"url": db_url}} if db_url else {}))
    p = Platform.from_settings(s)
    if db_url is None:
        Base.metadata.create_all(p.engine)
    return p


def cluster(p: Platform, jobs: tuple[tuple[str, int], ...] = (("one", 1), ("two", 2), ("late", 1)),
            ) -> dict[str, dict[str, tuple[int, int]]]:
    """Four registered nodes and ``jobs`` (name, nodes) placed on them; returns {job name: {node:
    (job id, attempt)}}."""
    with p.sessions() as s:
        for n in NODES:
            agents.register(session=s, settings=p.settings, hello=AgentHello(
                node=n, zone="A", leaf="A1", address="127.0.0.1", fake_gpus=True,
                gpus=[GpuInfo(index=i, uuid=f"GPU-{n}-{i}", model="Fake", memory_total_mib=1) for i in range(8)]))
        user, _ = auth.create_user(session=s, name="alice", group="g")
        alice = auth.Principal(kind="user", user_id=user.id, name="alice", group="g")
        for name, nodes in jobs:
            job_service.submit_job(session=s, user=alice,
                                   spec=JobCreate(name=name, command=["true"], nodes=nodes, gpus_per_node=8))
    with p.sessions() as s:
        assert len(run_cycle(s, settings=p.settings).started) == len(jobs)
    with p.sessions() as s:
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for name, node, job_id, attempt in s.execute(
            select(Job.name, JobAllocation.node_name, Job.id, JobAllocation.attempt).join(JobAllocation)
        ):
            out.setdefault(name, {})[node] = (job_id, attempt)
    assert sorted(n for nodes in out.values() for n in nodes) == list(NODES)
    return out


def running(job_id: int, attempt: int) -> AttemptStatus:
    return AttemptStatus(job_id=job_id, attempt=attempt, ranks=[RankStatus(rank=0, local_rank=0, pid=7)])


def exited(job_id: int, attempt: int, node_rank: int = 0) -> AttemptStatus:
    return AttemptStatus(job_id=job_id, attempt=attempt, finished=True,
                         ranks=[RankStatus(rank=node_rank, local_rank=0, state="exited", exit_code=0)])


def rounds(jobs: dict[str, dict[str, tuple[int, int]]]):  # noqa: ANN201
    """Three rounds of reports, by node (each round ends with a node nobody registered)."""
    (one_node, one), = jobs["one"].items()
    (late_node, late), = jobs["late"].items()
    two_nodes = sorted(jobs["two"])
    two = jobs["two"][two_nodes[0]]
    first = {one_node: [running(*one)], two_nodes[0]: [running(*two)], two_nodes[1]: [running(*two)], late_node: []}
    second = {one_node: [exited(*one)], two_nodes[0]: [exited(*two, 0)], two_nodes[1]: [exited(*two, 1)],
              late_node: [running(*late)]}
    third = {one_node: [exited(*one)], two_nodes[0]: [], two_nodes[1]: [exited(*two, 1)], late_node: [exited(*late)]}
    return [first, second, third]


def drive(p: Platform, jobs, *, batched: bool) -> list[list[dict]]:  # noqa: ANN001
    replies: list[list[dict]] = []
    digests: dict[str, str | None] = {}
    for reports in rounds(jobs):
        hbs = [Heartbeat(node=n, attempts=a, assignments_digest=digests.get(n)) for n, a in reports.items()]
        hbs.append(Heartbeat(node="ghost", attempts=[]))
        if batched:
            with p.sessions() as s:
                got = agents.heartbeats(session=s, hbs=hbs, settings=p.settings)
        else:
            got = []
            for hb in hbs:
                with p.sessions() as s:
                    got.append(agents.heartbeat(session=s, hb=hb, settings=p.settings))
        for hb, r in zip(hbs, got):
            digests[hb.node] = r.assignments_digest
        replies.append([r.model_dump(mode="json") for r in got])
    return replies


def state(p: Platform) -> dict:
    with p.sessions() as s:
        return {
            "jobs": [(j.name, j.state, j.exit_code, j.attempt,
                      [(e.from_state, e.to_state, e.reason) for e in sorted(j.events, key=lambda e: e.id)])
                     for j in s.scalars(select(Job).order_by(Job.id))],
            "allocations": [(a.job_id, a.node_name, a.active, a.status)
                            for a in s.scalars(select(JobAllocation).order_by(JobAllocation.id))],
            "holds": s.scalar(select(func.count()).select_from(GpuHold)),
        }


def check_batched_equals_one_by_one(batched: Platform, single: Platform) -> None:
    jobs = cluster(batched)
    assert cluster(single) == jobs  # the same placement on both
    got = drive(batched, jobs, batched=True)
    want = drive(single, jobs, batched=False)
    assert got == want
    assert state(batched) == state(single)
    end = state(batched)
    assert [(name, st) for name, st, *_ in end["jobs"]] == [("one", "succeeded"), ("two", "succeeded"),
                                                           ("late", "succeeded")]
    two_events = [e for name, *_, events in end["jobs"] if name == "two" for e in events]
    assert [e[1] for e in two_events].count("succeeded") == 1  # its two nodes in one batch: judged once
    assert end["holds"] == 0 and not any(active for *_, active, _ in end["allocations"])
    assert all(r["reregister"] for rnd in got for r in rnd if r["node"] == "ghost")


def test_a_batch_of_heartbeats_does_and_answers_what_they_do_one_by_one(tmp_path):
    batched, single = make_platform(tmp_path / "batched"), make_platform(tmp_path / "single")
    try:
        check_batched_equals_one_by_one(batched, single)
    finally:
        batched.close()
        single.close()


def test_a_batch_names_each_node_once(platform):
    with platform.sessions() as s, pytest.raises(ValueError, match="one per node"):
        agents.heartbeats(session=s, hbs=[Heartbeat(node="a"), Heartbeat(node="a")], settings=platform.settings)
