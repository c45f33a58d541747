"""Issue 12: while preemptions are in flight, a count inside nearly every queued job's pending
reason moves every cycle ("(256 nodes reserved for other jobs)", then 288), and every cycle
rewrote the whole queue's rows (and the next read them all back). The scheduler process now
writes such a change, where only numbers differ, at each job's own refresh moment, spread over
``scheduler.pending_reason_refresh_s``; any other change is written by the cycle that makes it.

Driven through what a cycle of ``hai scheduler`` does: the queue cache's read of the shown
reasons (``_load`` with a ``QueueCache``), then ``apply_decisions`` with the domain's reasons,
committed; the rows are read back from the database."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from hai.db.base import utcnow
from hai.db.models import Job
from hai.domain import scheduler as sched
from hai.services import scheduling

from .test_queue_cache import _snapshot

JOBS = 60
REFRESH_S = 30.0
FREE_0 = "needs 1 GPU(s) on one node; the most free on any available node is 0 ({} nodes reserved for other jobs)"


def _cycle(api, cache, settings, now, reasons, reservations=None) -> None:  # noqa: ANN001
    _, current = _snapshot(api, cache)  # the reasons shown, as the cycle reads them
    with api.platform.sessions() as s:
        scheduling.apply_decisions(s, sched.Decisions(pending_reasons=reasons, reservations=reservations or {}),
                                   settings=settings, now=now, current=current)
        s.commit()


def _shown(api) -> dict[int, str | None]:  # noqa: ANN001
    with api.platform.sessions() as s:
        return dict(s.execute(select(Job.id, Job.pending_reason).where(Job.state == "queued")).all())


def test_a_reason_whose_numbers_alone_change_is_written_at_its_jobs_moment_any_other_change_at_once(api):
    api.register_node("n0")
    ids = [api.submit(gpus_per_node=1, name=f"q{i}")["id"] for i in range(JOBS)]  # (no cycle starts them)
    settings = api.platform.settings.model_copy(deep=True)
    settings.scheduler.pending_reason_refresh_s = REFRESH_S
    cache = scheduling.QueueCache()
    t0 = utcnow()

    # the first reasons this process writes: all at once
    _cycle(api, cache, settings, t0, {i: FREE_0.format(256) for i in ids})
    assert _shown(api) == {i: FREE_0.format(256) for i in ids}

    # the count moves: each second of the next refresh span writes only the jobs whose moment came,
    # a few a second (the moments spread evenly), and by its end every job shows the new count
    new = FREE_0.format(288)
    per_second = []
    for k in range(1, int(REFRESH_S) + 1):
        _cycle(api, cache, settings, t0 + timedelta(seconds=k), {i: new for i in ids})
        shown = _shown(api)
        assert set(shown.values()) <= {FREE_0.format(256), new}  # nothing else is ever shown
        per_second.append(sum(r == new for r in shown.values()) - sum(per_second))
    assert per_second[0] < JOBS / 10  # one second in, most jobs still show the old count
    assert max(per_second) <= JOBS / REFRESH_S + 2  # spread over the span, not all at one moment
    assert sum(per_second) == JOBS  # every job caught up within one span
    assert set(_shown(api).values()) == {new}

    # other words: written by the cycle that makes them, for every job
    t1 = t0 + timedelta(seconds=REFRESH_S + 1)
    other = "needs 2 GPU(s) on one node; the most free on any available node is 1"
    _cycle(api, cache, settings, t1, {i: other for i in ids})
    assert set(_shown(api).values()) == {other}

    # a job whose reservation changes has its reason written with it, numbers alone or not
    reserved, rest = ids[0], ids[1:]
    why = "waiting for {} job to reach a checkpoint; 1 node reserved (n7)"
    _cycle(api, cache, settings, t1 + timedelta(seconds=1), {reserved: why.format(1), **{i: other for i in rest}},
           reservations={reserved: ("n7",)})
    # (the same moment: a change of numbers alone would wait)
    _cycle(api, cache, settings, t1 + timedelta(seconds=1), {reserved: why.format(2), **{i: other for i in rest}},
           reservations={reserved: ("n8",)})
    with api.platform.sessions() as s:
        job = s.get(Job, reserved)
        assert (job.pending_reason, job.reserved_nodes) == (why.format(2), ["n8"])

    # refresh 0: every change at once, numbers alone included
    settings.scheduler.pending_reason_refresh_s = 0
    _cycle(api, cache, settings, t1 + timedelta(seconds=3), {i: other.replace("is 1", "is 3") for i in ids})
    assert set(_shown(api).values()) == {other.replace("is 1", "is 3")}


def test_the_refresh_setting_is_checked():
    import pytest
    from pydantic import ValidationError

    from hai.settings import Settings

    assert Settings().scheduler.pending_reason_refresh_s == 30.0
    with pytest.raises(ValidationError, match="pending_reason_refresh_s"):
        Settings(scheduler={"pending_reason_refresh_s": -1})
