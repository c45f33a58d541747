"""Wake-ups between parts of the system: the scheduler after a submission, an agent's long
poll after its node's assignments change, log followers after new lines.

A notification only says "look again": the database stays the one source of truth, so a lost
notification costs latency, never correctness. In embedded mode everything is in-process; with
Redis (production) every publish also goes to a Redis channel and a listener thread re-publishes
what other processes sent.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import defaultdict

log = logging.getLogger(__name__)

SCHEDULER = "scheduler"
TOKENS = "tokens"  # a token was revoked: API processes drop their cached credentials


def publish_after_commit(session, *topics: str) -> None:  # noqa: ANN001
    """Queue notifications on a SQLAlchemy session; context.Platform publishes them once the
    transaction commits (and drops them on a rollback)."""
    session.info.setdefault("notify", set()).update(topics)


def node_topic(name: str) -> str:
    return f"node:{name}"


def job_topic(job_id: int) -> str:
    return f"job:{job_id}"


class Notifier:
    """In-process topics with a version counter; waiters are threads or asyncio tasks.

    Alone (no Redis), it cannot hear what other processes publish: ``poll_s`` then bounds every
    wait that another process may need to end (``bounded``), and the waiter re-reads the
    database; with Redis, ``poll_s`` is None and waits last as long as their callers ask."""

    poll_s: float | None = None
    released = False  # the server is stopping: async waits end at once (``release_waiters``)

    def bounded(self, timeout: float) -> float:
        """``timeout``, capped at ``poll_s`` when notifications do not cross processes."""
        return timeout if self.poll_s is None else min(timeout, self.poll_s)

    def __init__(self, *, poll_s: float | None = None) -> None:
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._versions: dict[str, int] = defaultdict(int)
        # bumped whenever notifications may have been lost (a Redis error): what was cached
        # against topic versions must be read again
        self.epoch = 0
        self._async_waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = defaultdict(list)

    # -- publishing -------------------------------------------------------------------------
    def publish(self, *topics: str) -> None:
        self._deliver(topics)

    def _deliver(self, topics) -> None:  # noqa: ANN001
        with self._cond:
            waiters = []
            for topic in topics:
                self._versions[topic] += 1
                waiters.extend(self._async_waiters.pop(topic, []))
            self._cond.notify_all()
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    # -- waiting ----------------------------------------------------------------------------
    def version(self, topic: str) -> int:
        with self._lock:
            return self._versions[topic]

    def wait(self, topic: str, since: int, timeout: float) -> bool:
        """Block a thread until ``topic`` moves past version ``since`` or the timeout passes."""
        with self._cond:
            return self._cond.wait_for(lambda: self._versions[topic] != since, timeout=timeout)

    async def wait_async(self, topic: str, since: int, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if self.released or self._versions[topic] != since:
                return True
            self._async_waiters[topic].append((loop, fut))
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            with self._lock:
                waiters = self._async_waiters.get(topic, [])
                if (loop, fut) in waiters:
                    waiters.remove((loop, fut))
            return False

    def release_waiters(self) -> None:
        """The server is stopping: every async wait ends now, as if its topic had moved, and every
        later one at once (held long polls answer, log follows end), so that the server's
        graceful shutdown need not wait out the longest of them. Any thread may call it (each
        waiter is resolved on its own loop), but not a signal handler: it takes the lock."""
        with self._lock:
            self.released = True
            waiters = [w for ws in self._async_waiters.values() for w in ws]
            self._async_waiters.clear()
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    def close(self) -> None:
        pass


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(True)


class RedisNotifier(Notifier):
    """Notifier whose topics cross processes through Redis pub/sub."""

    CHANNEL = "hai:notify"

    # issue 12: a SCHEDULER wake-up sent less than this after this process's last publish waits
    # for the rest of that time and goes out with every other one queued meanwhile (one message,
    # not one per submission: each cost the publisher a Redis round trip, ~8% of a submission's
    # instructions, and every listening process a message). The scheduler merges wake-ups within
    # HAI_SCHEDULER__COALESCE_S (0.2 s) anyway. Every other topic goes out at once, with any
    # queued wake-up.
    COALESCE_S = 0.02
    COALESCED = frozenset({SCHEDULER})
    # issue 12: proof that notifications arrive. Every TICK_S this process publishes a tick (a
    # message without topics, which other processes ignore) and its listener hears it back; a
    # tick sent and not heard for STALE_S means that what others publish may not arrive either,
    # or arrives that late (a subscription that died without an error, a half-open connection, a
    # Redis restart between two reads, a listener that far behind): the epoch moves then, and again
    # every listener round until a tick comes back, so nothing cached against topic versions
    # (the heartbeat reply cache) outlives a silent loss by more than about STALE_S.
    TICK_S = 1.0
    STALE_S = 5.0
    RETRY_S = 1.0  # a publish that failed is sent again this much later (with what came meanwhile)

    def __init__(self, url: str, *, coalesce_s: float | None = None, coalesced: frozenset[str] | None = None,
                 tick_s: float | None = None, stale_s: float | None = None) -> None:
        super().__init__()
        self.tick_s = self.TICK_S if tick_s is None else tick_s
        self.stale_s = self.STALE_S if stale_s is None else stale_s
        self._tick_at = float("-inf")  # when the last tick was sent
        self._unheard_since: float | None = None  # when the oldest tick not heard back was sent
        self.ticks_heard = 0
        import redis

        self._origin = uuid.uuid4().hex
        self._redis = redis.Redis.from_url(url)
        # pub/sub channels ignore the database number: name the channel after it, so platforms
        # sharing one Redis server on different databases do not wake each other
        db = self._redis.connection_pool.connection_kwargs.get("db", 0)
        self.CHANNEL = f"{RedisNotifier.CHANNEL}:{db}"
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(self.CHANNEL)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="hai-redis-notify", daemon=True)
        self._thread.start()
        self.coalesce_s = self.COALESCE_S if coalesce_s is None else coalesce_s
        self.coalesced = self.COALESCED if coalesced is None else coalesced
        self._out = threading.Condition()
        self._queued: set[str] = set()  # wake-ups waiting for the flusher
        self._sent_at = float("-inf")
        self._flusher = threading.Thread(target=self._flush, name="hai-redis-notify-out", daemon=True)
        self._flusher.start()

    def publish(self, *topics: str) -> None:
        self._deliver(topics)
        with self._out:
            now = time.monotonic()
            if self.coalesced.issuperset(topics) and now - self._sent_at < self.coalesce_s:
                if not self._queued:
                    self._out.notify()
                self._queued.update(topics)
                return
            topics = tuple(sorted(self._queued.union(topics)))
            self._queued.clear()
            self._sent_at = now
        self._send(topics)

    def _send(self, topics) -> None:  # noqa: ANN001
        try:
            self._redis.publish(self.CHANNEL, self._origin + "|" + ",".join(topics))
        except Exception:  # Redis can be lost without losing a job: callers poll too
            self.epoch += 1
            log.warning("could not publish %s to Redis (sent again in %.0f s)", topics, self.RETRY_S, exc_info=True)
            if topics:
                # issue 12: kept and sent again, not dropped: another process's cached replies are
                # dropped by this message (a lost one would leave them until their time runs out)
                with self._out:
                    self._queued.update(topics)
                    self._sent_at = max(self._sent_at, time.monotonic() + self.RETRY_S - self.coalesce_s)
                    self._out.notify()

    def _tick(self) -> None:
        """Publish a tick (no topics) for this process's listener to hear back (``TICK_S``)."""
        now = time.monotonic()
        self._tick_at = now
        if self._unheard_since is None:
            self._unheard_since = now
        self._send(())

    def _flush(self) -> None:
        """Send the queued wake-ups once ``coalesce_s`` has passed since the last publish."""
        with self._out:
            while not self._stop.is_set():
                tick_due = self._tick_at + self.tick_s - time.monotonic()
                if tick_due <= 0:
                    self._out.release()
                    try:
                        self._tick()
                    finally:
                        self._out.acquire()
                    continue
                if not self._queued:
                    self._out.wait(tick_due)
                    continue
                due = self._sent_at + self.coalesce_s - time.monotonic()
                if due > 0:
                    self._out.wait(min(due, tick_due))
                    continue
                topics = tuple(sorted(self._queued))
                self._queued.clear()
                self._sent_at = time.monotonic()
                self._out.release()
                try:
                    self._send(topics)
                finally:
                    self._out.acquire()

    def _listen(self) -> None:
        stale = False
        while not self._stop.is_set():
            try:
                msg = self._pubsub.get_message(timeout=min(1.0, self.tick_s))
            except Exception:
                self.epoch += 1
                log.warning("Redis notify listener error; retrying", exc_info=True)
                self._stop.wait(1.0)
                continue
            # a tick still unheard after stale_s: lost on the way, or this listener is that far
            # behind (what others publish reaches it at least that late): either way what was
            # cached against topic versions may be stale. Checked after every read, not only when
            # the subscription is idle: with a tick per process per second it seldom is.
            unheard = self._unheard_since
            if unheard is not None and time.monotonic() - unheard > self.stale_s:
                self.epoch += 1
                if not stale:
                    log.warning("no tick back from Redis for %.0f s: notifications may be lost", self.stale_s)
                stale = True
            if not msg:
                continue
            data = msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"])
            origin, _, topics = data.partition("|")
            if origin != self._origin:
                if topics:
                    self._deliver(topics.split(","))
            elif not topics:  # our tick: what was sent before it has arrived
                self._unheard_since = None
                self.ticks_heard += 1
                stale = False

    def close(self) -> None:
        self._stop.set()
        with self._out:
            self._out.notify()
            queued = tuple(sorted(self._queued))
            self._queued.clear()
        self._flusher.join(timeout=3)
        if queued:  # not dropped at shutdown
            self._send(queued)
        self._thread.join(timeout=3)
        try:
            self._pubsub.close()
            self._redis.close()
        except Exception:
            pass


def make_notifier(redis_url: str, *, poll_s: float | None = None) -> Notifier:
    """With Redis, wake-ups cross processes; without, waits are bounded by ``poll_s``."""
    return RedisNotifier(redis_url) if redis_url else Notifier(poll_s=poll_s)
