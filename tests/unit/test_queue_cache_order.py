"""Issue 12: the scheduler's queue cache hands the domain its queue ordered by id. After an
incremental read of a few rows it no longer sorts every job: it takes the last tuple and puts the
rows read in or out at their places (``QueueCache.queued`` / ``_merged``). Whatever the reads,
the tuple must be the one a sort of the cached jobs gives, with every job the very object the
cache holds, and the account of how it differs from the last (``delta``) must be true."""

from __future__ import annotations

import random

import pytest

from hai.domain.jobs import Priority
from hai.domain.scheduler import QueuedJob
from hai.services import scheduling
from hai.services.scheduling import QueueCache


def _job(i: int, version: int = 0) -> QueuedJob:
    return QueuedJob(i, f"u{i % 7}", "g", Priority.NORMAL, 1, 1, float(i), float(i + version))


def _check(cache: QueueCache, last: tuple[QueuedJob, ...] | None, touched: set[int]) -> tuple[QueuedJob, ...]:
    got = cache.queued()
    want = sorted(cache.jobs.values(), key=lambda q: q.id)
    assert [q.id for q in got] == [q.id for q in want]
    assert all(a is b for a, b in zip(got, want))  # the cache's own objects, none other
    assert cache._ids == [q.id for q in got]
    delta = cache.delta
    if last is not None and got is not last:
        assert delta is not None and delta.base is last and delta.queued is got
        assert {q.id for q in delta.changed} | set(delta.gone) == touched
        assert all(cache.jobs[q.id] is q for q in delta.changed)
        assert not set(delta.gone) & cache.jobs.keys()
    return got


@pytest.mark.parametrize("seed", range(6))
def test_the_queue_after_a_few_rows_read_is_the_sorted_queue(seed: int, monkeypatch) -> None:  # noqa: ANN001
    """Random reads of a few rows (new jobs at the end and in between, jobs gone, jobs changed,
    a job gone and back, several reads before the queue is asked for), some cycles with no row
    read, and now and then a full read; the queue is compared with a sort after each."""
    merges = []
    real = scheduling._merged
    monkeypatch.setattr(scheduling, "_merged", lambda *a: merges.append(1) or real(*a))
    rng = random.Random(seed)
    cache = QueueCache()
    ids = rng.sample(range(1, 40_000), 2_000)
    cache.jobs = {i: _job(i) for i in ids}
    cache._read(ids, full=True)
    last = _check(cache, None, set())
    next_id = 40_000
    for step in range(120):
        if step % 40 == 39:  # a full read: the same jobs, new objects
            cache.jobs = {i: _job(i, step) for i in cache.jobs}
            cache._read(list(cache.jobs), full=True)
            last = _check(cache, None, set())
            continue
        touched: set[int] = set()
        for _ in range(rng.choice([0, 1, 1, 2])):  # reads before the cycle asks for the queue
            read: list[int] = []
            for _ in range(rng.randint(1, 30)):
                kind = rng.random()
                if kind < 0.3:  # a new job: mostly the newest, sometimes an old id back in the queue
                    i = next_id if rng.random() < 0.7 else rng.randrange(1, 40_000)
                    next_id += 1
                    cache.jobs[i] = _job(i, step)
                elif kind < 0.6 and cache.jobs:  # a job that left (started, cancelled, held)
                    i = rng.choice(list(cache.jobs))
                    del cache.jobs[i]
                elif cache.jobs:  # a job's row changed: a new object
                    i = rng.choice(list(cache.jobs))
                    cache.jobs[i] = _job(i, step + 1)
                else:
                    continue
                read.append(i)
            cache._read(read, full=False)
            touched.update(read)
        last = _check(cache, last, touched)
        if not touched:
            assert cache.queued() is last  # no row read: the very same tuple
    assert len(merges) > 50  # the incremental path was taken (few rows against 2,000 jobs)


def test_many_rows_read_sort_the_queue_again(monkeypatch) -> None:  # noqa: ANN001
    """More than an eighth of the queue read: sorted again (the merge would cost as much); the
    result the same either way."""
    cache = QueueCache()
    cache.jobs = {i: _job(i) for i in range(1, 101)}
    cache._read(list(cache.jobs), full=True)
    last = cache.queued()
    changed = list(range(1, 101, 3))  # 34 of 100 rows
    for i in changed:
        cache.jobs[i] = _job(i, 1)
    cache._read(changed, full=False)
    monkeypatch.setattr(scheduling, "_merged", None)  # not called
    _check(cache, last, set(changed))
