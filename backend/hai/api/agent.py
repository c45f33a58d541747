"""Agent protocol endpoints (node credential only)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from hai.api.early import EarlyAnswer
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


HEARTBEAT_PATH = router.prefix + "/heartbeat"


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


def _answer_steady(cache: agent_service.ReplyCache | None, notifier, hb: Heartbeat):  # noqa: ANN001, ANN202
    """(the cache entry that answered ``hb``, or None; the node topic's version and the notifier's
    epoch read before the lookup, which a full pass stores its reply under). An entry that
    answered has noted the heartbeat's liveness and buffered its GPU figures (``ReplyCache.answer``)."""
    since = notifier.version(notify.node_topic(hb.node))
    epoch = notifier.epoch
    steady = cache.lookup(hb, version=since, epoch=epoch) if cache is not None else None
    if steady is not None and not cache.answer(hb, steady):
        steady = None
    return steady, since, epoch


@router.post("/heartbeat", response_model=ServerReply)
async def heartbeat(hb: Heartbeat, request: Request, platform: PlatformDep, _agent: AgentPrincipal) -> ServerReply:
    """Apply the agent's report and answer with the node's assignments. With ``wait_s`` the
    reply is held (long poll) until the assignments change, unless the agent is already behind."""
    # issue 12: a steady heartbeat is answered from the reply cache in the event loop: no worker
    # thread, no database (its liveness is written in the next batch), the reply's JSON as cached
    agent_service.check_version(hb.protocol_version)
    topic = notify.node_topic(hb.node)
    notifier = platform.notifier
    cache = _reply_cache(request, platform)
    steady, since, epoch = _answer_steady(cache, notifier, hb)
    if steady is not None:
        if hb.wait_s <= 0:
            return Response(steady.body, media_type="application/json")
        reply = steady.reply
    else:
        if cache is not None:
            cache.miss(hb, version=since, epoch=epoch)

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


class SteadyHeartbeats(EarlyAnswer):
    """A steady heartbeat answered before routing (issue 12, ``hai.api.early``).

    At 1,250 agents a second nearly every request is a heartbeat that changes nothing, which
    the reply cache answers without the database; what it still cost was the framework around it
    (routing, dependency resolution, the body's second validation as a route parameter, the
    response's middleware), about two thirds of a cached answer's CPU (py-spy ``--gil`` of the
    workers during agent_fanin.py). Here such a heartbeat is answered from the same cache with the
    same bytes, by the same rules as the route's own cached branch: an agent credential already in
    this process's token cache, a JSON body that validates as a ``Heartbeat`` of a supported
    version, no long poll, and an entry that ``ReplyCache.lookup`` and ``answer`` accept. Anything
    else (a miss, another body) goes on to the route, so errors, 401/403/422/426 and full passes
    stay the route's."""

    path = HEARTBEAT_PATH
    principal_kind = "agent"

    def applies(self, request: Request, platform) -> bool:  # noqa: ANN001
        return _reply_cache(request, platform) is not None

    async def answer(self, request: Request, platform, principal, body: bytes):  # noqa: ANN001, ANN201
        try:
            hb = Heartbeat.model_validate_json(body)
            agent_service.check_version(hb.protocol_version)
        except Exception:  # noqa: BLE001 - the route refuses it with its own error
            return None
        if hb.wait_s > 0:
            return None
        steady, _, _ = _answer_steady(_reply_cache(request, platform), platform.notifier, hb)
        return None if steady is None else (200, steady.body)


class QuietHeartbeats(logging.Filter):
    """Drops uvicorn's access-log line of an agent heartbeat answered with 2xx (issue 12): at
    1,250 nodes that is 1,250 lines a second saying nothing (the node's liveness is in the
    database and on the nodes page); a refused heartbeat is still logged. It runs before the
    token redaction (``guards.install_redaction``), whose regular expression the dropped lines
    then skip: the access line, its redaction and its write were ~16% of a worker's event loop
    during a fan-in (py-spy ``--gil``). ``HAI_AGENT__ACCESS_LOG_HEARTBEATS=true`` keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn: access_logger.info('%s - "%s %s HTTP/%s" %d', client, method, path, version, status)
        args = record.args
        return not (isinstance(args, tuple) and len(args) == 5 and args[2] == HEARTBEAT_PATH
                    and args[1] == "POST" and isinstance(args[4], int) and 200 <= args[4] < 300)


def quiet_heartbeat_access_log(quiet: bool = True) -> None:
    """Install (or, for ``HAI_AGENT__ACCESS_LOG_HEARTBEATS=true``, remove) the filter on uvicorn's
    access logger, which is the process's: the last app started says."""
    logger = logging.getLogger("uvicorn.access")
    present = [f for f in logger.filters if isinstance(f, QuietHeartbeats)]
    if quiet and not present:
        logger.filters.insert(0, QuietHeartbeats())  # first: before the redaction's work
    elif not quiet:
        for f in present:
            logger.removeFilter(f)
