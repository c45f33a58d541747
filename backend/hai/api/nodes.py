from __future__ import annotations

from fastapi import APIRouter

from hai.api.deps import CurrentUser, SessionDep
from hai.schemas.common import GpuRead, NodeRead
from hai.services import nodes as node_service

router = APIRouter(prefix="/api/v1/nodes", tags=["nodes"])


@router.get("", response_model=list[NodeRead])
def list_nodes(session: SessionDep, _user: CurrentUser) -> list[NodeRead]:
    out = []
    for s in node_service.list_nodes(session=session):
        n = s.node
        inventory = {g["index"]: g for g in (n.gpu_inventory or [])}
        metrics = {g["index"]: g for g in (n.gpu_metrics or [])}
        gpus = [GpuRead(**{**inventory.get(i, {}), **metrics.get(i, {}), "index": i}) for i in sorted(inventory | metrics)]
        out.append(
            NodeRead(
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
                gpu_metrics=gpus,
            )
        )
    return out
