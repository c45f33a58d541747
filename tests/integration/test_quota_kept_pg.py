"""Issue 12 on PostgreSQL: the scheduler process keeps each quota bucket's GPUs from one cycle to
the next, updated from the running jobs that came and left (``ActiveCache`` hands the domain a
``RunningDelta``; ``quota.KeptCharges`` applies it) instead of summing every running job each
cycle. Through the real service: a job that starts takes its group's quota, a job that ends
gives it back by the next cycle, and the cap is never exceeded."""

from __future__ import annotations

import threading

from sqlalchemy import select

from hai.db.base import utcnow
from hai.db.models import Job, JobAllocation
from hai.domain.jobs import JobState
from hai.services.jobs import transition
from hai.services.leader import leadership
from hai.services.reports import release
from hai.services.runner import SchedulerLoop
from tests.api.test_queue_cache import _cycle, _write


def _state(api, job_id: int) -> dict:  # noqa: ANN001
    return api.get(f"/api/v1/jobs/{job_id}", api.admin).json()


def _end(api, job_id: int) -> None:  # noqa: ANN001
    def end(s):  # noqa: ANN001, ANN202
        transition(s, s.get(Job, job_id), JobState.SUCCEEDED, reason="done", now=utcnow())
        for alloc in s.scalars(select(JobAllocation).where(JobAllocation.job_id == job_id)):
            release(alloc, utcnow())
    _write(api, end)


def test_a_job_that_ends_gives_its_quota_back_by_the_next_cycle_on_postgresql(pg_api):
    api = pg_api
    for n in ("n0", "n1"):
        api.register_node(n)  # 16 GPUs in all: only the quota holds jobs back
    r = api.client.put("/api/v1/quotas", json={"items": [{"group": "vision", "priority": "NORMAL", "gpus": 8}]},
                       headers=api.h(api.admin))
    assert r.status_code == 200, r.text
    ids = [api.submit(gpus_per_node=4, name=f"q{i}")["id"] for i in range(4)]
    loop = SchedulerLoop(api.platform)
    charges = loop.queue.kept.charges
    with leadership(api.platform, stop=threading.Event()) as lease:
        assert _cycle(api, loop, lease).started == ids[:2]  # 8 of the group's 8 GPUs
        full = "group vision at NORMAL uses 8 of 8 GPUs; this job needs 4"
        assert _state(api, ids[2])["pending_reason"] == full
        assert _cycle(api, loop, lease).started == []  # the same running jobs: still full
        sums = charges.sums
        _end(api, ids[0])
        assert _cycle(api, loop, lease).started == [ids[2]]  # its 4 GPUs given back, taken again
        assert _state(api, ids[3])["pending_reason"] == full
        _end(api, ids[1])
        _end(api, ids[2])
        assert _cycle(api, loop, lease).started == [ids[3]]  # 4 of 8 used now
        assert _cycle(api, loop, lease).started == []
        one = api.submit(gpus_per_node=8, name="eight")["id"]
        assert _cycle(api, loop, lease).started == []
        assert _state(api, one)["pending_reason"] == "group vision at NORMAL uses 4 of 8 GPUs; this job needs 8"
    # the charges followed the jobs that came and left: no sum over every running job since
    assert charges.sums == sums and charges.accounts >= 2
    assert [_state(api, i)["state"] for i in ids] == ["succeeded", "succeeded", "succeeded", "starting"]
