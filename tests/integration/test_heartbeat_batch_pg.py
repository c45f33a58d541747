"""Issue 14 on PostgreSQL: a batch of heartbeats in one transaction does what the same
heartbeats do one by one (``tests/api/test_heartbeat_batch.py``), and batches that run side by
side and share jobs (a two-node job's nodes in two batches, named in opposite orders) wait for
each other instead of deadlocking: the job is judged once, every GPU released."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hai.db.migrate import upgrade
from hai.protocol import Heartbeat
from hai.services import agents
from tests.api.test_heartbeat_batch import check_batched_equals_one_by_one, cluster, exited, make_platform, state
from tests.integration.conftest import pg_url, second_pg_url, server_db_url  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration


def test_a_batch_does_what_the_heartbeats_do_one_by_one_on_postgresql(pg_url, second_pg_url, tmp_path: Path):  # noqa: F811
    upgrade(pg_url)
    upgrade(second_pg_url)
    batched, single = make_platform(tmp_path / "b", pg_url), make_platform(tmp_path / "s", second_pg_url)
    try:
        check_batched_equals_one_by_one(batched, single)
    finally:
        batched.close()
        single.close()


def test_batches_sharing_jobs_side_by_side_wait_for_each_other(pg_url, tmp_path: Path):  # noqa: F811
    upgrade(pg_url)
    p = make_platform(tmp_path / "p", pg_url)
    try:
        jobs = cluster(p, (("x", 2), ("y", 2)))
        x1, x2 = sorted(jobs["x"])
        y1, y2 = sorted(jobs["y"])
        x, y = jobs["x"][x1], jobs["y"][y1]
        # each batch holds one node of each job, the jobs in opposite orders: without the locks
        # taken at once, in id order, each batch would lock one job and wait for the other's
        batches = [
            [Heartbeat(node=x1, attempts=[exited(*x, 0)]), Heartbeat(node=y1, attempts=[exited(*y, 0)])],
            [Heartbeat(node=y2, attempts=[exited(*y, 1)]), Heartbeat(node=x2, attempts=[exited(*x, 1)])],
        ]
        go = threading.Barrier(len(batches))
        errors: list[BaseException] = []

        def send(hbs: list[Heartbeat]) -> None:
            try:
                for _ in range(5):  # the same reports again: idempotent, and more chances to collide
                    go.wait(30)
                    with p.sessions() as s:
                        agents.heartbeats(session=s, hbs=hbs, settings=p.settings)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(hbs,)) for hbs in batches]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        end = state(p)
        assert {name: st for name, st, *_ in end["jobs"]} == {"x": "succeeded", "y": "succeeded"}
        for job in ("x", "y"):
            events = [e for name, *_, evs in end["jobs"] if name == job for e in evs]
            assert [e[1] for e in events].count("succeeded") == 1
        assert end["holds"] == 0
    finally:
        p.close()
