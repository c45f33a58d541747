"""A stopping server ends the requests that wait for a notification (``Notifier.release_waiters``,
called by ``hai dev`` when its graceful shutdown begins): a held wait ends at once, later waits
do not start, and a followed log ends with a ``limit`` event that tells the client to follow
again, so the shutdown does not wait out the longest long poll or follow."""

from __future__ import annotations

import asyncio
import threading

from hai.agent.testing import wait_for
from hai.services import notify
from hai.services.notify import Notifier


def test_release_ends_a_held_wait_and_every_later_one():
    n = Notifier()
    loop = asyncio.new_event_loop()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(loop.run_until_complete(n.wait_async("t", 0, 600.0))), daemon=True)
    t.start()
    try:
        wait_for(lambda: n._async_waiters.get("t"), what="the wait registered")
        assert not got  # held: nothing was published on its topic
        n.release_waiters()
        t.join(30)
        assert got == [True] and not t.is_alive()  # ended long before its 600 s
        # a wait that starts after the release ends at once, without a waiter left behind
        assert loop.run_until_complete(asyncio.wait_for(n.wait_async("u", 0, 600.0), 30)) is True
        assert not n._async_waiters.get("u")
    finally:
        loop.close()


def test_a_followed_log_ends_with_a_limit_event_when_the_server_stops(api):
    api.register_node("n0")
    job = api.submit(gpus_per_node=1)  # queued: its log would be followed until the job ends
    topic = notify.job_topic(job["id"])

    def stop_when_waiting():
        wait_for(lambda: api.platform.notifier._async_waiters.get(topic), what="the follow waiting for lines")
        api.platform.notifier.release_waiters()

    t = threading.Thread(target=stop_when_waiting, daemon=True)
    t.start()
    with api.client.stream("GET", f"/api/v1/jobs/{job['id']}/logs", params={"follow": "true"},
                           headers=api.h(api.alice)) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln.startswith(("event:", "data:"))]
    t.join(30)
    assert lines == ["event: limit", "data: the server is stopping; follow again"]
