"""Nodes: list, one node with its events, and node health (issue 10): drain, undrain, validate,
validation runs. Admin-only actions use AdminUser (401 without a token, 403 for others)."""

from __future__ import annotations

import enum
from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from pydantic import TypeAdapter
from starlette.concurrency import run_in_threadpool

from hai.api.deps import AdminUser, CurrentUser, PlatformDep, SessionDep
from hai.schemas.common import ErrorRead, GpuRead, NodeRead
from hai.schemas.nodes import (
    ChecksFailedError,
    NodeDetail,
    NodeDrain,
    NodeEventRead,
    NodeUndrain,
    NodeValidate,
    ValidationRunRead,
)
from hai.services import node_health
from hai.services import nodes as node_service

router = APIRouter(prefix="/api/v1/nodes", tags=["nodes"])
validations_router = APIRouter(prefix="/api/v1/validations", tags=["nodes"])


def _read(s: node_service.NodeSummary) -> NodeRead:
    n = s.node
    gpus = [GpuRead(**g) for g in node_service.gpu_figures(n.gpu_inventory, n.gpu_metrics)]
    return NodeRead(
        name=n.name,
        zone=n.zone,
        leaf=n.leaf,
        gpus=n.gpus,
        free_gpus=s.free_gpus,
        state=n.state,
        state_reason=n.state_reason,
        address=n.address,
        fake_gpus=n.fake_gpus,
        last_heartbeat_at=n.last_heartbeat_at,
        running_jobs=s.running_jobs,
        gpu_util_pct=n.gpu_util_pct,
        gpus_busy=n.gpus_busy or 0,
        gpu_metrics=gpus,
    )


def _detail(session, name: str) -> NodeDetail:  # noqa: ANN001
    s = node_service.node_summary(session=session, name=name)
    latest = node_health.latest_validation(session, name)
    return NodeDetail(
        **_read(s).model_dump(),
        state_changed_at=s.node.state_changed_at,
        state_detail=s.node.state_detail,
        events=[NodeEventRead.model_validate(e) for e in s.node.events],
        latest_validation=ValidationRunRead.model_validate(latest) if latest is not None else None,
    )


_NODE_LIST = TypeAdapter(list[NodeRead])


class NodeInclude(str, enum.Enum):
    GPU_METRICS = "gpu_metrics"


@router.get("", response_model=list[NodeRead])
def list_nodes(
    session: SessionDep,
    platform: PlatformDep,
    _user: CurrentUser,
    include: Annotated[
        list[NodeInclude] | None,
        Query(description="`gpu_metrics`: also every GPU's inventory and latest figures (2 MB at 1,250 nodes; "
              "GET /nodes/{name} has one node's)"),
    ] = None,
) -> Response:
    """Every node with its state, free GPUs, running jobs and GPU utilisation (mean and busy count);
    per-GPU figures only with `include=gpu_metrics` (issue 12: they were nearly all of this list's cost).
    Labels, states, free GPUs and running jobs are current as of the request; each node's heartbeat
    time and utilisation may be up to `HAI_HTTP__NODE_LIST_MAX_AGE_S` (1 s) older than its last
    heartbeat (the list is kept per API process while nothing else in it changed)."""
    if NodeInclude.GPU_METRICS in (include or ()):  # the agents' JSON documents: validated into GpuRead
        rows = node_service.list_nodes(session=session, gpu_metrics=True)
        return Response(_NODE_LIST.dump_json(_NODE_LIST.validate_python(rows)), media_type="application/json")
    # NodeRead's fields unvalidated, in its field order: on PostgreSQL the database writes the
    # document, on SQLite pydantic-core serialises the typed columns (tests compare both forms
    # with the model-validated list); kept while its revision is current (HAI_HTTP__NODE_LIST_MAX_AGE_S)
    return Response(platform.node_list.get(session=session), media_type="application/json")


@router.get("/{name}", response_model=NodeDetail)
def get_node(name: str, session: SessionDep, _user: CurrentUser) -> NodeDetail:
    """The node with its state, state_reason, events (oldest first) and latest finished validation."""
    return _detail(session, name)


@router.post("/{name}/drain", response_model=NodeDetail)
def drain(name: str, body: NodeDrain, session: SessionDep, user: AdminUser) -> NodeDetail:
    """Take the node out of scheduling; its jobs move off at their checkpoint (admins only)."""
    node_health.drain_node(session=session, name=name, reason=body.reason, user=user)
    return _detail(session, name)


@router.post("/{name}/undrain", response_model=NodeDetail, responses={409: {"model": ChecksFailedError | ErrorRead, "description": "failed checks, or a node that is not drained"}})
async def undrain(name: str, platform: PlatformDep, user: AdminUser, body: NodeUndrain | None = None) -> NodeDetail:
    """Back to ready after a passing full validation (waits for it); 409 names the failed checks.
    ``force`` skips the gate and records that it was forced (admins only)."""
    await run_in_threadpool(node_health.undrain_node, platform=platform, name=name, force=(body or NodeUndrain()).force,
                            user=user)

    def _after() -> NodeDetail:
        with platform.sessions() as session:
            return _detail(session, name)

    return await run_in_threadpool(_after)


@router.post("/{name}/validate", response_model=ValidationRunRead, status_code=status.HTTP_202_ACCEPTED)
def validate(name: str, session: SessionDep, user: AdminUser, body: NodeValidate | None = None) -> ValidationRunRead:
    """Run the validator suite on the node now (full by default); answers with the run (its id)."""
    run = node_health.validate_node(session=session, name=name, user=user, level=(body or NodeValidate()).level)
    return ValidationRunRead.model_validate(run)


@router.get("/{name}/validations", response_model=list[ValidationRunRead])
def list_validations(name: str, session: SessionDep, _user: CurrentUser,
                     limit: int = Query(50, ge=1, le=500)) -> list[ValidationRunRead]:
    """The node's validation runs, newest first, each with its checks."""
    return [ValidationRunRead.model_validate(r) for r in node_health.list_validations(session=session, name=name, limit=limit)]


@validations_router.get("/{run_id}", response_model=ValidationRunRead)
def get_validation(run_id: int, session: SessionDep, _user: CurrentUser) -> ValidationRunRead:
    return ValidationRunRead.model_validate(node_health.get_validation(session=session, run_id=run_id))
