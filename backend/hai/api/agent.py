"""Agent protocol endpoints (node credential only)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from hai.api.deps import AgentPrincipal, PlatformDep
from hai.protocol import AgentHello, Heartbeat, LogAck, LogBatch, ServerReply
from hai.services import agents as agent_service
from hai.services import logs as log_service
from hai.services import notify

router = APIRouter(prefix="/api/v1/agent", tags=["agent"])


@router.post("/register", response_model=ServerReply)
def register(hello: AgentHello, platform: PlatformDep, _agent: AgentPrincipal) -> ServerReply:
    with platform.sessions() as session:
        return agent_service.register(session=session, hello=hello, settings=platform.settings)


@router.post("/heartbeat", response_model=ServerReply)
async def heartbeat(hb: Heartbeat, platform: PlatformDep, _agent: AgentPrincipal) -> ServerReply:
    """Apply the agent's report and answer with the node's assignments. With ``wait_s`` the
    reply is held (long poll) until the assignments change, unless the agent is already behind."""
    topic = notify.node_topic(hb.node)
    since = platform.notifier.version(topic)

    def _apply() -> ServerReply:
        with platform.sessions() as session:
            return agent_service.heartbeat(session=session, hb=hb, settings=platform.settings)

    reply = await run_in_threadpool(_apply)
    if hb.wait_s <= 0 or reply.reregister or reply.assignments_digest != hb.assignments_digest:
        return reply
    # a held poll does not refresh the node's last heartbeat: hold it well inside lost_after_s (the agent fences itself at 3/4 of it)
    wait_s = min(hb.wait_s, platform.settings.agent.lost_after_s / 4)
    if not await platform.notifier.wait_async(topic, since, wait_s):
        return reply

    def _current() -> ServerReply:
        with platform.sessions() as session:
            return agent_service.current_reply(session=session, node_name=hb.node, settings=platform.settings)

    return await run_in_threadpool(_current)


@router.post("/logs", response_model=LogAck)
def logs(batch: LogBatch, platform: PlatformDep, _agent: AgentPrincipal) -> LogAck:
    with platform.sessions() as session:
        return LogAck(accepted=log_service.append_batch(session=session, batch=batch))
