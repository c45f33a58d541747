"""Each suspension carries a machine-readable code beside its sentence."""

from __future__ import annotations

from hai.domain.scheduler import SuspendCode, schedule
from tests.unit.scheduler_builders import cluster, job, policy

NOW = 1_000_000.0
HOUR = 3600.0


def test_a_higher_priority_job_suspends_with_the_outranked_code():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("low").priority("LOW").started(NOW - HOUR))
    c.queue(job("high").priority("HIGH").user("bob").queued_at(NOW))
    (s,) = schedule(c.snapshot(), policy(), NOW).suspends
    assert (s.job_id, s.for_job_id, s.code) == (c.id_of("low"), c.id_of("high"), SuspendCode.OUTRANKED)
    assert "outranks" in s.reason


def test_time_sharing_suspends_with_the_time_sharing_code():
    c = cluster().zone("A", leaves=1, nodes_per_leaf=1)
    c.run(job("long").user("ann").started(NOW - 5 * HOUR))
    c.queue(job("w").user("bob").queued_at(NOW - HOUR))
    (s,) = schedule(c.snapshot(), policy(), NOW).suspends
    assert (s.job_id, s.code) == (c.id_of("long"), SuspendCode.TIME_SHARING)
    assert s.code == "time_sharing" and s.reason.startswith("time-sharing:")
