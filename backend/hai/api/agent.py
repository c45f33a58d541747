"""Agent protocol endpoints (node credential only)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
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


def _reply_cache(request: Request, platform) -> agent_service.ReplyCache | None:  # noqa: ANN001
    """The process's cache of steady replies; only with Redis, whose notifications reach every API
    process (without it another process's change would not invalidate this one's cache)."""
    settings = platform.settings
    if not settings.redis.url or settings.agent.reply_cache_s <= 0:
        return None
    cache = getattr(request.app.state, "reply_cache", None)
    if cache is None:
        cache = request.app.state.reply_cache = agent_service.ReplyCache(
            settings.agent.reply_cache_s, sessions=platform.sessions, engine=platform.engine, settings=settings,
            flush_s=settings.agent.liveness_flush_s)
    return cache


@router.post("/heartbeat", response_model=ServerReply)
async def heartbeat(hb: Heartbeat, request: Request, platform: PlatformDep, _agent: AgentPrincipal) -> ServerReply:
    """Apply the agent's report and answer with the node's assignments. With ``wait_s`` the
    reply is held (long poll) until the assignments change, unless the agent is already behind."""
    # issue 12: a steady heartbeat is answered from the reply cache in the event loop: no worker
    # thread, no database (its liveness is written in the next batch), the reply's JSON as cached
    agent_service.check_version(hb.protocol_version)
    topic = notify.node_topic(hb.node)
    notifier = platform.notifier
    since = notifier.version(topic)
    epoch = notifier.epoch
    cache = _reply_cache(request, platform)
    steady = cache.lookup(hb, version=since, epoch=epoch) if cache is not None else None
    if steady is not None and cache.answer(hb, steady):
        if hb.wait_s <= 0:
            return Response(steady.body, media_type="application/json")
        reply = steady.reply
    else:
        def _apply() -> ServerReply:
            with platform.sessions() as session:
                seen: dict = {}
                reply = agent_service.heartbeat(session=session, hb=hb, settings=platform.settings, seen=seen)
                if cache is not None:
                    cache.store(hb, reply, seen=seen, version=since, epoch=epoch)
                return reply

        reply = await run_in_threadpool(_apply)
    if hb.wait_s <= 0 or reply.reregister or reply.assignments_digest != hb.assignments_digest:
        return reply

    def _current() -> ServerReply:
        with platform.sessions() as session:
            return agent_service.current_reply(session=session, node_name=hb.node, settings=platform.settings)

    # a held poll does not refresh the node's last heartbeat: hold it well inside lost_after_s
    # (the agent fences itself at 3/4 of it)
    deadline = time.monotonic() + min(hb.wait_s, platform.settings.agent.lost_after_s / 4)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return reply
        if await notifier.wait_async(topic, since, notifier.bounded(remaining)):
            return await run_in_threadpool(_current)
        if notifier.poll_s is None:
            return reply
        # no Redis: the scheduler or another replica may have changed the assignments unheard
        since = notifier.version(topic)
        reply = await run_in_threadpool(_current)
        if reply.assignments_digest != hb.assignments_digest:
            return reply


@router.post("/logs", response_model=LogAck)
def logs(batch: LogBatch, platform: PlatformDep, _agent: AgentPrincipal) -> LogAck:
    agent_service.check_version(batch.protocol_version)
    with platform.sessions() as session:
        accepted = log_service.append_batch(
            session=session, batch=batch, max_line_chars=platform.settings.limits.max_log_line_chars
        )
        return LogAck(accepted=accepted)
