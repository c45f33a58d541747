"""Jobs as the API shows them (JobRead / JobList): the ORM rows mapped by field name, with the
zone and leaf of every node the job is placed on (one query per response, for the nodes the
response places jobs on only; none when no job is placed, as after a submission)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from hai.db.models import Job, Node
from hai.schemas.jobs import JobEventRead, JobList, JobRead, PlacementRead
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


def job_list(*, session: Session, jobs: Sequence[Job], total: int, viewer: Principal | None = None) -> JobList:
    """Everyone sees the queue (as `squeue` does), but the environment of another user's job —
    where tokens and passwords live — only its owner and admins see; others get its keys with
    the values masked (GET /jobs/{id} of another's job is a 403 altogether)."""
    labels = _labels_for(session, jobs)
    items = [_read(j, labels) for j in jobs]
    if viewer is not None and not viewer.is_admin:
        for item, job in zip(items, jobs):
            if job.user_id != viewer.user_id:
                item.env = dict.fromkeys(item.env, HIDDEN)
    return JobList(items=items, total=total)
