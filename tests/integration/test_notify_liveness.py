"""The Redis notifier proves that notifications arrive (issue 12, the fan-in's fourth pass): each process
publishes a tick that its own listener hears back, and a tick not heard back while nothing else
is waiting to be read moves the epoch (what was cached against topic versions is read again); a
publish that failed is sent again instead of dropped. These are what let the heartbeat reply
cache keep an entry for ``HAI_AGENT__REPLY_CACHE_S`` (60 s) instead of 10 s. The tests wait for
conditions with a deadline; no assertion is about time."""

from __future__ import annotations

import time
import uuid

import pytest

from hai.services.notify import RedisNotifier

pytestmark = pytest.mark.integration


def _until(condition, timeout: float = 20.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_ticks_come_back_and_the_epoch_holds_while_they_do(redis_url):
    n = RedisNotifier(redis_url, tick_s=0.05, stale_s=60)
    try:
        assert _until(lambda: n.ticks_heard >= 3), "the notifier's ticks did not come back through Redis"
        assert n.epoch == 0
    finally:
        n.close()


def test_ticks_that_stop_coming_back_move_the_epoch_until_they_come_again(redis_url):
    n = RedisNotifier(redis_url, tick_s=0.05, stale_s=1.0)
    # another process ticking on the channel: the listener is never idle, and that must not hide
    # that its own ticks stopped coming back
    busy = RedisNotifier(redis_url, tick_s=0.02)
    try:
        assert _until(lambda: n.ticks_heard >= 1)
        channel, heard = n.CHANNEL, n.ticks_heard
        # what this process publishes no longer reaches its listener, without any error: as a
        # subscription that died silently (a half-open connection) would look from inside
        n.CHANNEL = f"elsewhere-{uuid.uuid4().hex}"
        epoch = n.epoch
        assert _until(lambda: n.epoch > epoch), "a silent notification path did not move the epoch"
        moved = n.epoch
        assert _until(lambda: n.epoch > moved), "the epoch moved once, not on every round while silent"
        assert n.ticks_heard == heard
        n.CHANNEL = channel  # the path works again: ticks come back, the epoch stays put
        assert _until(lambda: n.ticks_heard >= heard + 2)
        settled = n.epoch
        assert _until(lambda: n.ticks_heard >= heard + 6)
        assert n.epoch == settled
    finally:
        n.close()
        busy.close()


def test_a_publish_that_failed_is_sent_again(redis_url):
    a, b = RedisNotifier(redis_url), RedisNotifier(redis_url)
    topic = f"node:retry-{uuid.uuid4().hex[:8]}"
    publish = a._redis.publish
    failed = []

    def flaky(channel, message):  # noqa: ANN001, ANN202 - the first publish of the topic fails
        if topic in str(message) and not failed:
            failed.append(message)
            raise ConnectionError("Redis went away (test)")
        return publish(channel, message)

    a._redis.publish = flaky
    try:
        since, epoch = b.version(topic), a.epoch
        a.publish(topic)
        assert failed, "the publish did not go through the failing path"
        assert a.epoch > epoch  # this process's own cache is read again
        assert b.wait(topic, since, 20), "a failed publish was dropped, not sent again"
    finally:
        a.close()
        b.close()
