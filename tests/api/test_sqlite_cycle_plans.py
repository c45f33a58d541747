"""Issue 12, SQLite flat with queue depth: a steady scheduling cycle (the queue kept across cycles,
``QueueCache``) reads the jobs table through its indexes, also after ANALYZE has gathered the
statistics of a deep queue. With those statistics (half the table a state) SQLite's planner
chose to scan the whole table for the few active jobs, a cost that grows with the queue. The
same holds for a quiet cycle (nothing queued) over a long history of finished jobs."""

from __future__ import annotations

import threading

from sqlalchemy import event, text

from hai.services import scheduling
from hai.services.leader import leadership

QUEUED = 1_500  # two batches; 16 of them start on the two nodes of 8 GPUs


def _cycle(platform, lease, queue) -> scheduling.CycleResult:  # noqa: ANN001
    """As the scheduler process runs a cycle on SQLite: read (and plan) in a read-only
    transaction, write the decisions in a fenced one."""
    with platform.read_sessions() as reading, platform.sessions() as session:
        return scheduling.run_cycle(session, settings=platform.settings, lease=lease, read_session=reading, queue=queue)


def _plans(platform, statements: list[tuple[str, tuple]]) -> list[tuple[str, list[str]]]:  # noqa: ANN001
    """Each SELECT that names the jobs table, with SQLite's plan for it (EXPLAIN QUERY PLAN with
    the parameters it ran with): the plan's details, one a table or index it visits."""
    out = []
    with platform.engine.connect() as conn:
        for sql, params in statements:
            if sql.lstrip().upper().startswith("SELECT") and "jobs" in sql:
                rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params).all()
                out.append((sql, [r[-1] for r in rows]))
    return out


def test_a_steady_cycle_scans_no_jobs_table_after_analyze_over_a_deep_queue(api):
    api.register_node("n0")
    api.register_node("n1")
    for part in range(2):
        jobs = [{"name": f"q{part}-{i}", "command": ["sleep", "60"], "gpus_per_node": 1} for i in range(QUEUED // 2)]
        r = api.post("/api/v1/jobs/batch", json={"jobs": jobs})
        assert r.status_code == 201, r.text
    platform = api.platform
    queue = scheduling.QueueCache()
    statements: list[tuple[str, tuple]] = []

    def seen(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001, ANN202
        if not executemany:
            statements.append((statement, tuple(parameters)))

    def recorded(cycle):  # noqa: ANN001, ANN202
        """The cycle's result and the plans of its SELECTs on jobs, after ANALYZE."""
        with platform.sessions() as s:
            s.execute(text("ANALYZE"))
            s.commit()
            # what made the planner scan: a state's rows estimated at half the table or more
            rows, per_state, _ = map(int, s.execute(
                text("SELECT stat FROM sqlite_stat1 WHERE idx = 'ix_jobs_state_id'")).scalar_one().split())
            assert per_state * 2 >= rows
        statements.clear()
        event.listen(platform.engine, "before_cursor_execute", seen)
        try:
            got = cycle()
        finally:
            event.remove(platform.engine, "before_cursor_execute", seen)
        return got, _plans(platform, statements)

    def no_scan(plans) -> None:  # noqa: ANN001
        scans = [(sql, plan) for sql, plan in plans if any(d == "SCAN jobs" or d.startswith("SCAN jobs ") for d in plan)]
        assert not scans, scans
        assert all(plan for _, plan in plans)

    with leadership(platform, stop=threading.Event()) as lease:
        first = _cycle(platform, lease, queue)
        assert len(first.started) == 16
        _cycle(platform, lease, queue)  # the pending reasons' rows read back: settled
        steady, plans = recorded(lambda: _cycle(platform, lease, queue))
        assert not steady.started and len(steady.considered) == QUEUED - 16
        # the cycle read the active jobs (those it starts, runs or suspends) and nothing read
        # the jobs table whole
        assert any("jobs.state IN" in sql for sql, _ in plans), [sql for sql, _ in plans]
        no_scan(plans)
        # the queue drained into the history (cancelled): a quiet cycle, whose read of the
        # active jobs' GPUs (with their allocations) must not scan the history either
        with platform.sessions() as s:
            s.execute(text("UPDATE jobs SET state = 'cancelled' WHERE state = 'queued'"))
            s.commit()
        quiet, plans = recorded(lambda: _cycle(platform, lease, queue))
    assert not quiet.started and not quiet.considered
    assert any("jobs.state IN" in sql and "job_allocations" in sql for sql, _ in plans), [sql for sql, _ in plans]
    no_scan(plans)
