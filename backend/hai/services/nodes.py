"""Node queries and the topology file."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
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


def list_nodes(*, session: Session) -> list[NodeSummary]:
    nodes = list(session.scalars(select(Node).order_by(Node.zone, Node.leaf, Node.name)))
    held: dict[str, set[int]] = {}
    jobs: dict[str, set[int]] = {}
    # rows, not ORM objects: a cluster of 1,250 busy nodes holds ~10,000 active allocations
    for node_name, job_id, gpus in session.execute(
        select(JobAllocation.node_name, JobAllocation.job_id, JobAllocation.gpus).where(JobAllocation.active.is_(True))
    ):
        held.setdefault(node_name, set()).update(gpus)
        jobs.setdefault(node_name, set()).add(job_id)
    return [
        NodeSummary(node=n, free_gpus=n.gpus - len(held.get(n.name, set())), running_jobs=sorted(jobs.get(n.name, set())))
        for n in nodes
    ]


def node_summary(*, session: Session, name: str) -> NodeSummary:
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise NotFound(f"node {name} not found")
    held: set[int] = set()
    jobs: set[int] = set()
    for alloc in session.scalars(
        select(JobAllocation).where(JobAllocation.node_name == name, JobAllocation.active.is_(True))
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
