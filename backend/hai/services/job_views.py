"""Jobs as the API shows them (JobRead / JobList): the ORM rows mapped by field name, with the
zone and leaf of every node the job is placed on (one query per response, for the nodes the
response places jobs on only; none when no job is placed, as after a submission).

The job list (issue 12: 100,000 jobs, p99 <= 20 ms) reads column rows, not ORM objects: the page,
its jobs' events and their placements (with the nodes' labels) are three queries, and the total is
counted only as far as it is cheap (``COUNT_CAP``); see ``list_jobs``."""

from __future__ import annotations

import enum
import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json, to_json
from sqlalchemy import JSON, Integer, Row, Text, bindparam, cast, func, literal, select
from sqlalchemy.orm import Session

from hai.db.models import Job, JobAllocation, JobEvent, Node
from hai.domain.jobs import JobState
from hai.schemas.jobs import CheckpointRead, JobEventRead, JobList, JobRead, PlacementRead, ProgressRead
from hai.services.auth import Principal
from hai.services.jobs import SUBMITTED, placement_of

Labels = dict[str, tuple[str, str]]

# JobRead fields whose column has another name; every other field is read from the column of
# its own name (placement is computed)
_COLUMN = {"user": "user_name", "held": "user_suspended"}
_FIELDS = [(f, _COLUMN.get(f, f)) for f in JobRead.model_fields if f != "placement"]
_UNKNOWN = ("?", "?")


def node_labels(session: Session, names: set[str] | None = None) -> Labels:
    """(zone, leaf) of the nodes ``names`` (default: every node)."""
    stmt = select(Node.name, Node.zone, Node.leaf)
    if names is not None:
        if not names:
            return {}
        stmt = stmt.where(Node.name.in_(sorted(names)))
    return {name: (zone, leaf) for name, zone, leaf in session.execute(stmt)}


def _labels_for(session: Session, jobs: Sequence[Job]) -> Labels:
    return node_labels(session, {a.node_name for j in jobs for a in placement_of(j)})


def _read(job: Job, labels: Labels) -> JobRead:
    data = {field: getattr(job, column) for field, column in _FIELDS}
    data["env"] = job.env or {}
    data["tags"] = job.tags or []
    data["placement"] = [
        PlacementRead(node=a.node_name, zone=labels.get(a.node_name, _UNKNOWN)[0],
                      leaf=labels.get(a.node_name, _UNKNOWN)[1], gpus=a.gpus)
        for a in placement_of(job)
    ]
    return JobRead.model_validate(data, from_attributes=True)


def job_read(*, session: Session, job: Job) -> JobRead:
    return _read(job, _labels_for(session, [job]))


def job_reads(*, session: Session, jobs: Sequence[Job]) -> list[JobRead]:
    """Several jobs, their nodes' labels read once."""
    labels = _labels_for(session, jobs)
    return [_read(job, labels) for job in jobs]


def submitted_read(row: Row) -> JobRead:
    """A job just written by ``jobs.submit_job`` (its row of every column): not placed, one
    event. Built from the row the INSERT returned, without reading anything back (issue 12)."""
    data = {field: getattr(row, column) for field, column in _FIELDS if field != "events"}
    data["env"] = row.env or {}
    data["tags"] = row.tags or []
    data["placement"] = []
    data["events"] = [JobEventRead(at=row.created_at, from_state=None, to_state=row.state, reason=SUBMITTED)]
    return JobRead.model_validate(data)


HIDDEN = "***"


# -- the job list --------------------------------------------------------------------------
class CountMode(str, enum.Enum):
    """How ``total`` is counted: ``auto`` exactly up to ``COUNT_CAP`` matching jobs (then a lower
    bound, ``total_exact`` false), ``exact`` always (reads every matching index entry: ~16 ms per
    100,000 jobs on PostgreSQL)."""

    AUTO = "auto"
    EXACT = "exact"


# beyond this many matching jobs (or the page's own depth, if deeper) ``total`` is a lower bound
# unless ``count=exact`` is asked: counting 10,000 index entries costs ~2 ms, 100,000 ~16 ms
COUNT_CAP = 10_000

# the columns a JobRead needs (events and placement are read separately), and user_id for masking;
# the JSON columns as their text, parsed by pydantic-core (``_json``): psycopg's loader (the
# standard library's json.loads of bytes) cost ~3 ms per page of 50 jobs at load ~7, ~13x
# pydantic-core's parser (issue 12)
_JSON_COLUMNS = {column for field, column in _FIELDS if field != "events" and isinstance(Job.__table__.c[column].type, JSON)}
_LIST_COLUMNS = [cast(Job.__table__.c[column], Text).label(column) if column in _JSON_COLUMNS else Job.__table__.c[column]
                 for field, column in _FIELDS if field != "events"] + [Job.user_id]


def _json(text: str | None) -> Any:
    """A JSON column's value from its text (SQL NULL: None)."""
    return None if text is None else from_json(text)


@dataclass
class JobPage:
    rows: list[Any]  # RowMapping of _LIST_COLUMNS
    total: int
    total_exact: bool


def list_jobs(
    *,
    session: Session,
    state: Sequence[JobState] = (),
    user_name: str | None = None,
    limit: int = 50,
    offset: int = 0,
    before_id: int | None = None,
    count: CountMode = CountMode.AUTO,
) -> JobPage:
    """Newest first. ``before_id``: keyset paging (the jobs below that id; pass the last id of the
    previous page), which costs one page whatever the depth; ``offset`` walks past its rows.
    ``total`` counts every job of the filter (not only those below ``before_id``): exactly when
    the page itself shows it is the last one, or when at most ``COUNT_CAP`` jobs match (a count
    that stops there); otherwise it is that cap and ``total_exact`` is false ("more than
    ``total``"), unless ``count`` is ``exact``. Counts and pages read the list's indexes
    (ix_jobs_state_id, ix_jobs_user_name_id, ix_jobs_user_name_state_id)."""
    params: dict[str, Any] = {"limit": limit, "offset": offset}
    if state:
        params["states"] = [s.value for s in state]
    if user_name:
        params["user_name"] = user_name
    if before_id is not None:
        params["before_id"] = before_id
    cap = None if count == CountMode.EXACT else max(COUNT_CAP, offset + limit)
    if cap is not None:
        params["count_limit"] = cap + 1
    shape = (bool(state), bool(user_name), before_id is not None, cap is None)
    conn = session.connection()  # Core statements: the ORM's per-statement compile state is not needed
    rows = list(conn.execute(_page_statement(*shape, deep=offset > 0), params).mappings())
    if before_id is None and len(rows) < limit and (rows or offset == 0):
        return JobPage(rows, offset + len(rows), True)  # the last page: every job is before it or on it
    if rows:
        counted = int(rows[0]["_counted"])
    else:  # a page past the end
        counted = int(conn.scalar(_count_statement(shape[0], shape[1], cap is None), params) or 0)
    if cap is None or counted <= cap:
        return JobPage(rows, counted, True)
    return JobPage(rows, cap, False)


# The list's statements, one per shape of the request (which filters, keyset or not, bounded count
# or exact, deep page or not; 32 at most), built once with bound parameters: building the page's
# select of 32 columns with its count and generating its cache key cost ~1 ms of CPU per request
# (issue 12). The SQL sent is the same as when built per request.
def _filters(by_state: bool, by_user: bool) -> list:
    where = []
    if by_state:
        where.append(Job.state.in_(bindparam("states", expanding=True)))
    if by_user:
        where.append(Job.user_name == bindparam("user_name"))
    return where


@functools.cache
def _count_statement(by_state: bool, by_user: bool, exact: bool):  # noqa: ANN202
    """count(*) of the jobs the filters select (not only below ``before_id``), stopping after
    ``count_limit`` of them unless ``exact``."""
    where = _filters(by_state, by_user)
    if exact:
        return select(func.count()).select_from(Job).where(*where)
    bounded = select(literal(1)).select_from(Job).where(*where).limit(bindparam("count_limit", type_=Integer))
    return select(func.count()).select_from(bounded.subquery())


@functools.cache
def _page_statement(by_state: bool, by_user: bool, below: bool, exact: bool, *, deep: bool):  # noqa: ANN202
    """The page, newest first, with the count riding along (an uncorrelated subquery: evaluated
    once, one round trip)."""
    where = _filters(by_state, by_user)
    counted = _count_statement(by_state, by_user, exact).scalar_subquery().label("_counted")
    keyset = [Job.id < bindparam("before_id", type_=Integer)] if below else []
    if deep:
        # a deep page: the offset walks the list's index only (ids), then the page's rows are read;
        # walking whole rows read 5,000 rows of the heap for ?offset=5000 (issue 12)
        ids = (select(Job.id).where(*where, *keyset).order_by(Job.id.desc())
               .limit(bindparam("limit", type_=Integer)).offset(bindparam("offset", type_=Integer)))
        page = select(*_LIST_COLUMNS, counted).where(Job.id.in_(ids.scalar_subquery()))
    else:
        page = select(*_LIST_COLUMNS, counted).where(*where, *keyset).limit(bindparam("limit", type_=Integer))
    return page.order_by(Job.id.desc())


_EVENTS = (select(JobEvent.job_id, JobEvent.at, JobEvent.from_state, JobEvent.to_state, JobEvent.reason)
           .where(JobEvent.job_id.in_(bindparam("ids", expanding=True))).order_by(JobEvent.id))
_PLACEMENTS = (select(JobAllocation.job_id, JobAllocation.node_name, cast(JobAllocation.gpus, Text), Node.zone, Node.leaf)
               .join(Job, Job.id == JobAllocation.job_id)
               .outerjoin(Node, Node.name == JobAllocation.node_name)
               .where(JobAllocation.job_id.in_(bindparam("ids", expanding=True)), JobAllocation.attempt == Job.attempt)
               .order_by(JobAllocation.job_id, JobAllocation.node_rank))


def _page_items(session: Session, page: JobPage, viewer: Principal | None) -> list[dict]:
    """The page's jobs as JobRead fields (dicts): their events (oldest first) and the placements
    of their latest attempts, with the placed nodes' zone and leaf, one query each. Another
    user's environment is masked for non-admins: everyone sees the queue (as `squeue` does), but
    the environment of another user's job, where tokens and passwords live, only its owner and
    admins see; others get its keys with the values masked (GET /jobs/{id} of another's job is a
    403 altogether)."""
    ids = [r["id"] for r in page.rows]
    events: dict[int, list[dict]] = defaultdict(list)
    placements: dict[int, list[dict]] = defaultdict(list)
    if ids:
        conn = session.connection()
        for job_id, at, from_state, to_state, reason in conn.execute(_EVENTS, {"ids": ids}):
            events[job_id].append({"at": at, "from_state": from_state, "to_state": to_state, "reason": reason})
        for job_id, node, gpus, zone, leaf in conn.execute(_PLACEMENTS, {"ids": ids}):
            placements[job_id].append({"node": node, "zone": zone or _UNKNOWN[0], "leaf": leaf or _UNKNOWN[1],
                                       "gpus": _json(gpus)})
    mask = viewer is not None and not viewer.is_admin
    items = []
    for r in page.rows:
        data = {field: _json(r[column]) if column in _JSON_COLUMNS else r[column]
                for field, column in _FIELDS if field != "events"}
        env = data["env"] or {}
        data["env"] = dict.fromkeys(env, HIDDEN) if mask and r["user_id"] != viewer.user_id else env
        data["tags"] = data["tags"] or []
        data["events"] = events.get(r["id"], [])
        data["placement"] = placements.get(r["id"], [])
        items.append(data)
    return items


def job_list_page(*, session: Session, page: JobPage, viewer: Principal | None = None) -> JobList:
    """The page as JobList (see ``_page_items``)."""
    return JobList.model_validate({"items": _page_items(session, page, viewer), "total": page.total,
                                   "total_exact": page.total_exact})


def job_list_json(*, session: Session, page: JobPage, viewer: Principal | None = None) -> bytes:
    """``job_list_page(...).model_dump_json()`` without validating the page first: every field but
    the two free-form JSON documents (``last_checkpoint``, ``progress``, validated here as their
    models) comes from a typed column (integers, floats, booleans, UTC datetimes, the enums'
    values as text) or from the events' and placements' columns, already what JobRead would hold,
    so pydantic-core writes them as they are. Validating 50 jobs with their events was ~12% of the
    list's server CPU (py-spy, issue 12). The same document as the model's (keys in the same
    order): tests/integration/test_read_paths_pg.py."""
    items = _page_items(session, page, viewer)
    for data in items:
        if data["last_checkpoint"] is not None:
            data["last_checkpoint"] = CheckpointRead.model_validate(data["last_checkpoint"])
        if data["progress"] is not None:
            data["progress"] = ProgressRead.model_validate(data["progress"])
    ordered = [{field: data[field] for field in _ORDER} for data in items]
    return to_json({"items": ordered, "total": page.total, "total_exact": page.total_exact})


_ORDER = tuple(JobRead.model_fields)
