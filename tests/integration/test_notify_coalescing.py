"""Scheduler wake-ups through Redis are coalesced per process (issue 12, fourth pass): the first
goes out at once, those within ``coalesce_s`` of the last publish go out together once it has
passed (or with the next publish of another topic, or at close); other topics are never held.
Each test waits on the receiving notifier's condition, never on a clock: a window of 60 s makes
"held" certain, and a delivery well within the wait's timeout proves it was not held."""

from __future__ import annotations

import uuid

import pytest

from hai.services.notify import SCHEDULER, RedisNotifier


@pytest.fixture
def wake() -> str:
    """A wake-up topic of this test's own (other processes on this Redis database may publish the
    real SCHEDULER topic meanwhile), coalesced as SCHEDULER is."""
    return f"scheduler-{uuid.uuid4().hex}"


def test_only_scheduler_wakeups_are_coalesced_by_default():
    assert RedisNotifier.COALESCED == {SCHEDULER}


def test_a_burst_of_wakeups_is_one_message_and_other_topics_are_not_held(redis_url, wake):
    a, b = RedisNotifier(redis_url, coalesce_s=60, coalesced={wake}), RedisNotifier(redis_url)
    try:
        v0 = b.version(wake)
        a.publish(wake)  # a quiet publisher: at once
        assert b.wait(wake, v0, 20)
        v1 = b.version(wake)
        a.publish(wake)  # within the window: held
        a.publish(wake)
        assert a.version(wake) == 3  # delivered in this process at once all the same
        other = f"node:{wake}"
        since = b.version(other)
        a.publish(other)  # not held, and it carries the held wake-ups with it
        assert b.wait(other, since, 20)
        assert b.version(wake) == v1 + 1  # the two held wake-ups: one message
    finally:
        a.close()
        b.close()


def test_held_wakeups_go_out_when_the_window_has_passed(redis_url, wake):
    a, b = RedisNotifier(redis_url, coalesce_s=1.0, coalesced={wake}), RedisNotifier(redis_url)
    try:
        v0 = b.version(wake)
        a.publish(wake)
        assert b.wait(wake, v0, 20)
        v1 = b.version(wake)
        a.publish(wake)  # held: nothing else is published, the flusher sends it after the window
        a.publish(wake)
        assert b.wait(wake, v1, 20)
        assert b.version(wake) == v1 + 1
    finally:
        a.close()
        b.close()


def test_held_wakeups_are_sent_at_close(redis_url, wake):
    a, b = RedisNotifier(redis_url, coalesce_s=60, coalesced={wake}), RedisNotifier(redis_url)
    try:
        v0 = b.version(wake)
        a.publish(wake)
        assert b.wait(wake, v0, 20)
        v1 = b.version(wake)
        a.publish(wake)  # held for a minute
        a.close()
        assert b.wait(wake, v1, 20)
    finally:
        a.close()
        b.close()
