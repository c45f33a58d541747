"""Issue 12 (fan-in): the batched liveness write of steady heartbeats (``agents.write_liveness``).
On PostgreSQL it is one statement over the batch as a JSON document; it must write exactly what
the executemany it replaced writes (``_write_liveness_each``, still SQLite's): a node's time, its
quick-round count added, its GPU figures (or its own kept when the batch has none for it), and
nothing for a node whose state moved since its answer."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from hai.db.models import Node
from hai.protocol import GpuMetrics
from hai.services import agents
from hai.settings import Settings
from tests.integration.conftest import pg_url, server_db_url, sessions  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

AT = datetime(2026, 12, 4, 2, 0, 0, 123456, tzinfo=timezone.utc)


def gpus(n: str, util: float | None, k: int = 8) -> list[GpuMetrics]:
    return [GpuMetrics(index=g, uuid=f"GPU-{n}-{g}", util_pct=util + g if util is not None else 0.0,
                       memory_used_mib=1000 + g, memory_total_mib=81559, temperature_c=40.5 if g % 2 else None,
                       power_w=300.25, ecc_uncorrected=None if g % 3 else 0) for g in range(k)]


def seed(sessions) -> None:  # noqa: ANN001
    with sessions() as s:
        for i, state in enumerate(("ready", "ready", "drained", "lost", "ready")):
            s.add(Node(name=f"n{i}", zone="A", leaf="L1", gpus=8, state=state, heartbeats_since_quick=i,
                       gpu_metrics=[{"index": 0, "uuid": "old", "util_pct": 1.0}], gpu_util_pct=1.0, gpus_busy=1))
        s.commit()


def batch() -> dict[str, agents._Beat]:
    return {
        "n0": agents._Beat(AT, "ready", gpus("n0", 10.0), 3),
        "n1": agents._Beat(AT + timedelta(seconds=1), "ready", [], 1),  # no figures: its own kept
        "n2": agents._Beat(AT, "drained", gpus("n2", 95.0, 2), 0),
        "n3": agents._Beat(AT, "ready", gpus("n3", 50.0), 2),  # answered ready, lost since: not written
        "n4": agents._Beat(AT, "ready", gpus("n4", None), 5),
        "n9": agents._Beat(AT, "ready", gpus("n9", 1.0), 1),  # deleted since: not written
    }


def rows(sessions) -> list[tuple]:  # noqa: ANN001
    with sessions() as s:
        return [(n.name, n.state, n.last_heartbeat_at, n.heartbeats_since_quick, n.gpu_metrics, n.gpu_util_pct,
                 n.gpus_busy) for n in s.scalars(select(Node).order_by(Node.name))]


def test_the_batched_liveness_write_writes_what_one_update_per_node_writes(sessions):  # noqa: F811
    settings = Settings()
    seed(sessions)
    with sessions() as s:
        assert agents._write_liveness_each(s, batch(), settings) == 4
        s.commit()
    want = rows(sessions)
    with sessions() as s:  # back to the seeded rows
        s.query(Node).delete()
        s.commit()
    seed(sessions)
    with sessions() as s:
        assert agents.write_liveness(session=s, beats=batch(), settings=settings) == 4
        s.commit()
    got = rows(sessions)
    assert got == want
    by = {r[0]: r for r in got}
    assert by["n0"][2] == AT and by["n0"][3] == 0 + 3 and by["n0"][5] == pytest.approx(13.5) and len(by["n0"][4]) == 8
    assert by["n1"][2] == AT + timedelta(seconds=1) and by["n1"][4][0]["uuid"] == "old" and by["n1"][5] == 1.0
    assert by["n3"][2] is None and by["n3"][3] == 3  # lost since its answer: untouched
    assert by["n4"][6] == 0 and by["n4"][3] == 4 + 5
