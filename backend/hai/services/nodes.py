"""Node queries and the topology file."""

from __future__ import annotations

import csv
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pydantic_core import to_json
from sqlalchemy import String, func, select, text
from sqlalchemy.orm import Session

from hai.db.models import JobAllocation, Node
from hai.domain.nodes import NodeState
from hai.services.errors import Invalid, NotFound
from hai.services.node_state import create_node


@dataclass
class NodeSummary:
    node: Node
    free_gpus: int
    running_jobs: list[int]


# the node list's columns: every NodeRead field but the per-GPU figures (issue 12)
_LIST_COLUMNS = (Node.name, Node.zone, Node.leaf, Node.gpus, Node.state, Node.state_reason, Node.address,
                 Node.fake_gpus, Node.last_heartbeat_at, Node.gpu_util_pct, Node.gpus_busy)


def gpu_figures(inventory: list[dict] | None, metrics: list[dict] | None) -> list[dict]:
    """Each GPU's inventory (uuid, model, memory) merged with its latest heartbeat figures, by index."""
    inv = {g["index"]: g for g in (inventory or [])}
    met = {g["index"]: g for g in (metrics or [])}
    return [{**inv.get(i, {}), **met.get(i, {}), "index": i} for i in sorted(inv | met)]


def list_nodes(*, session: Session, gpu_metrics: bool = False) -> list[dict[str, Any]]:
    """Every node as NodeRead fields (dicts), by zone, leaf and name, from column rows: the free
    GPUs and running jobs of each come from one aggregate over the active allocations (a row per
    node, not per allocation). Per-GPU figures (``gpu_metrics``: the inventory and the latest
    heartbeat's figures, two JSON documents per node to decode) only when asked: at 1,250 nodes
    they are 10,000 GPUs and 2 MB, and were nearly all of this list's cost (issue 12)."""
    # held GPUs: the sum of the active allocations' GPU counts (a GPU is held once at most: the
    # unique index of gpu_holds makes it so, whatever the code above the database does)
    held: dict[str, int] = {}
    jobs: dict[str, list[int]] = {}
    conn = session.connection()  # Core rows: the ORM's result processing per row is not needed here
    # WHERE active (not IS true): an index-only scan of ix_job_allocations_active (migration 0014)
    for name, n_gpus, job_ids in conn.execute(
        select(JobAllocation.node_name, func.sum(func.json_array_length(JobAllocation.gpus)),
               func.aggregate_strings(func.cast(JobAllocation.job_id, String), ","))
        .where(JobAllocation.active).group_by(JobAllocation.node_name)
    ):
        held[name] = int(n_gpus or 0)
        jobs[name] = sorted({int(j) for j in job_ids.split(",")}) if job_ids else []
    columns = _LIST_COLUMNS + ((Node.gpu_inventory, Node.gpu_metrics) if gpu_metrics else ())
    out = []
    # tuples, each node's dict built in NodeRead's field order (the route serialises them as they are)
    for (name, zone, leaf, gpus, state, reason, address, fake, heartbeat, util, busy, *figures) in conn.execute(
        select(*columns).order_by(Node.zone, Node.leaf, Node.name)
    ):
        out.append({"name": name, "zone": zone, "leaf": leaf, "gpus": gpus, "free_gpus": gpus - held.get(name, 0),
                    "state": state, "state_reason": reason, "address": address, "fake_gpus": fake,
                    "last_heartbeat_at": heartbeat, "running_jobs": jobs.get(name, []), "gpu_util_pct": util,
                    "gpus_busy": busy, "gpu_metrics": gpu_figures(*figures) if gpu_metrics else None})
    return out


# The light node list (every NodeRead field, gpu_metrics null) as one JSON document built by
# PostgreSQL in one statement, byte for byte what ``to_json(list_nodes(...))`` gives (issue 12):
# Python then only passes the text through. Per node: the same columns and the same aggregate of
# the active allocations as list_nodes (``WHERE active``: ix_job_allocations_active, index-only),
# its job ids sorted and distinct. Written as pydantic-core writes them: compact, keys in NodeRead's
# field order, strings escaped by to_json (the same escapes), datetimes in UTC as
# ``YYYY-MM-DDTHH:MM:SS[.ffffff]Z``, floats in their shortest form with ``.0`` on integral values
# below 1e15 (PostgreSQL writes ``40``) and exponents unpadded (``1.5e-7``, PostgreSQL ``1.5e-07``);
# from 1e15 to 1e16 PostgreSQL writes ``1e+15`` for Python's ``1000000000000000.0``, the same
# number (a GPU utilisation is 0-100). Every column concatenated is NOT NULL but the two
# coalesced here: a NULL would make its node's text NULL and string_agg would skip the node.
# (``\:`` is a literal colon for SQLAlchemy's text().)
_NODE_LIST_JSON_PG = text(r"""
SELECT (SELECT rev FROM node_list_revision WHERE id = 1) AS rev, '[' || coalesce(string_agg(
    '{"name"\:' || to_json(n.name)::text
    || ',"zone"\:' || to_json(n.zone)::text
    || ',"leaf"\:' || to_json(n.leaf)::text
    || ',"gpus"\:' || n.gpus
    || ',"free_gpus"\:' || (n.gpus - coalesce(h.held, 0))
    || ',"state"\:' || to_json(n.state)::text
    || ',"state_reason"\:' || to_json(n.state_reason)::text
    || ',"address"\:' || to_json(n.address)::text
    || ',"fake_gpus"\:' || CASE WHEN n.fake_gpus THEN 'true' ELSE 'false' END
    || ',"last_heartbeat_at"\:' || coalesce(
        '"' || replace(to_char(n.last_heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24\:MI\:SS.US"Z"'),
                       '.000000Z', 'Z') || '"', 'null')
    || ',"running_jobs"\:' || coalesce(array_to_json(h.jobs)::text, '[]')
    || ',"gpu_util_pct"\:' || CASE
        WHEN n.gpu_util_pct IS NULL THEN 'null'
        WHEN n.gpu_util_pct = trunc(n.gpu_util_pct) AND abs(n.gpu_util_pct) < 1e15 THEN n.gpu_util_pct::text || '.0'
        WHEN abs(n.gpu_util_pct) < 1e-4 THEN replace(n.gpu_util_pct::text, 'e-0', 'e-')  -- 1.5e-07 -> 1.5e-7
        ELSE n.gpu_util_pct::text END  -- NaN and Infinity too, as pydantic-core writes them
    || ',"gpus_busy"\:' || n.gpus_busy
    || ',"gpu_metrics"\:null}',
    ',' ORDER BY n.zone, n.leaf, n.name), '') || ']'
FROM nodes n LEFT JOIN (
    SELECT node_name, sum(json_array_length(gpus)) AS held, array_agg(DISTINCT job_id ORDER BY job_id) AS jobs
    FROM job_allocations WHERE active GROUP BY node_name
) h ON h.node_name = n.name
""")


_REVISION = text("SELECT rev FROM node_list_revision WHERE id = 1")


def node_list_revision(*, session: Session) -> int | None:
    """The node list's revision (``NodeListRevision``): raised by the database in every transaction
    that changes what the list shows but the heartbeats' figures."""
    return session.connection().execute(_REVISION).scalar_one_or_none()


def list_nodes_json_at(*, session: Session) -> tuple[int | None, bytes]:
    """The light node list (``list_nodes(gpu_metrics=False)``) as the JSON document the API serves,
    with the revision it was built at (read in the same snapshot). On PostgreSQL the database
    writes it in one statement: at 1,250 nodes the rows through SQLAlchemy, psycopg, dicts and
    pydantic-core cost the server ~20-25 ms of CPU per request (the database ~6-10), the statement
    costs the server ~1.5 ms (the database ~15-20; issue 12). On SQLite the rows go through
    pydantic-core, in the transaction that read the revision (one snapshot): SQLite writes a REAL in
    JSON with 15 significant digits (``33.3333333333333`` for 33.333333333333336), not the same
    document."""
    if session.get_bind().dialect.name == "postgresql":
        rev, doc = session.connection().execute(_NODE_LIST_JSON_PG).one()
        return rev, doc.encode()
    rev = node_list_revision(session=session)
    return rev, to_json(list_nodes(session=session))


def list_nodes_json(*, session: Session) -> bytes:
    """The light node list as the API serves it, built now (``list_nodes_json_at``)."""
    return list_nodes_json_at(session=session)[1]


class _Built(NamedTuple):
    rev: int
    at: float  # the clock when its build began
    doc: bytes


class NodeListCache:
    """The light node list as one API process last built it (issue 12: at 1,250 nodes building it
    costs ~16 ms of PostgreSQL's CPU; reading the revision ~0.1 ms). A request reads the revision
    and is served the kept document when it was built at that revision and is at most
    ``max_age_s`` old. Every change the list shows but the heartbeats' figures raises the revision
    in the transaction that makes it (database triggers: any process, raw SQL too), so a list
    read after a commit shows it: drains, registrations, starts and releases are never stale;
    ``last_heartbeat_at``, ``gpu_util_pct`` and ``gpus_busy`` are at most ``max_age_s`` older than
    the last heartbeat (plus one build, while one request of the process rebuilds an expired
    document and the others are served the previous one). One build at a time per process:
    requests that find the revision changed wait for it and take its document when it carries
    their revision. ``max_age_s`` 0: every request builds the list."""

    def __init__(self, max_age_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._built: _Built | None = None
        self.builds = 0  # documents built (benchmarks and tests read it)

    def _fresh(self, built: _Built | None, rev: int) -> bool:
        return built is not None and built.rev >= rev and self._clock() - built.at <= self.max_age_s

    def get(self, *, session: Session) -> bytes:
        rev = node_list_revision(session=session) if self.max_age_s > 0 else None
        if rev is None:  # not kept, or no revision row (a schema made without migration 0016's): built
            self.builds += 1
            return list_nodes_json(session=session)
        built = self._built  # one attribute: read whole, never half of an update
        if self._fresh(built, rev):
            return built.doc
        if built is not None and built.rev == rev:
            # only too old: one request builds it again, the others are served the kept one meanwhile
            if not self._lock.acquire(blocking=False):
                return built.doc
        else:
            self._lock.acquire()  # changed: wait for the build under way, which may carry the change
        try:
            built = self._built
            if self._fresh(built, rev):
                return built.doc
            began = self._clock()
            built_rev, doc = list_nodes_json_at(session=session)
            self.builds += 1
            # (on SQLite a request's snapshot dates from its first read: never replace a newer one)
            if built_rev is not None and (built is None or built_rev >= built.rev):
                self._built = _Built(built_rev, began, doc)
            return doc
        finally:
            self._lock.release()


def node_summary(*, session: Session, name: str) -> NodeSummary:
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise NotFound(f"node {name} not found")
    held: set[int] = set()
    jobs: set[int] = set()
    for alloc in session.scalars(
        select(JobAllocation).where(JobAllocation.node_name == name, JobAllocation.active)
    ):
        held.update(alloc.gpus)
        jobs.add(alloc.job_id)
    return NodeSummary(node=node, free_gpus=node.gpus - len(held), running_jobs=sorted(jobs))


def load_topology(*, session: Session, path: Path) -> int:
    """Create or relabel nodes from a CSV with the header node,gpus,leaf,zone. Nodes appear
    as 'lost' (no agent yet) until their agent registers; labels in the file win."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"node", "gpus", "leaf", "zone"} - set(reader.fieldnames or [])
        if missing:
            raise Invalid("topology", f"{path}: missing column(s) {', '.join(sorted(missing))}")
        rows = list(reader)
    existing = {n.name: n for n in session.scalars(select(Node))}
    for row in rows:
        node = existing.get(row["node"])
        if node is None:
            node = create_node(session, name=row["node"], state=NodeState.LOST, actor="topology",
                               reason="no agent has registered yet")
        node.zone = row["zone"]
        node.leaf = row["leaf"]
        node.labels_from_topology = True
        if not node.gpus:
            node.gpus = int(row["gpus"])
    session.commit()
    return len(rows)
