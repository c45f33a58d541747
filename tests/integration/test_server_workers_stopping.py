"""A ``hai server --workers N`` worker told to stop first ends the requests that wait for a
notification (``hai.main.release_waiters_on_signal``): a followed log ends with a ``limit``
event that tells the client to follow again, and the server exits, instead of its graceful
shutdown waiting for the follow (of a queued job: for as long as the job waits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx

from hai.db.migrate import upgrade
from tests.e2e.conftest import free_port, wait_for
from tests.integration.test_api_replicas import Procs, _healthy, sse

ADMIN = "hai_workers-stop-admin-token-0123456789"


def test_a_stopping_worker_ends_its_followed_logs_and_the_server_exits(pg_url, redis_url, tmp_path):
    upgrade(pg_url)
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    env = {
        **os.environ, "PYTHONUNBUFFERED": "1", "HAI_DB__URL": pg_url, "HAI_REDIS__URL": redis_url,
        "HAI_DATA_DIR": str(tmp_path / "data"), "HAI_FRONTEND_DIST": str(tmp_path / "none"),
        "HAI_AUTH__BOOTSTRAP_ADMIN_TOKEN": ADMIN,
    }
    procs = Procs(tmp_path, env)
    try:
        topology = tmp_path / "topology.csv"
        topology.write_text("node,gpus,leaf,zone\nn0,8,A1,A\n")  # a node, so that the job is valid
        server, server_log = procs.start("server", "server", "--port", str(port), "--workers", "2",
                                         "--topology", str(topology))
        wait_for(lambda: _healthy(api), timeout=120, what="the API to serve")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        # no scheduler and no agent: the job stays queued, so a follow of its log never ends by itself
        r = httpx.post(f"{api}/api/v1/jobs", headers=admin,
                       json={"name": "waits", "command": ["true"], "nodes": 1, "gpus_per_node": 1})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        # two follows, one on each connection the kernel hands to either worker
        events: list[list[tuple[str | None, str]]] = [[], []]
        opened = threading.Barrier(3, timeout=60)

        def follow(out: list[tuple[str | None, str]]) -> None:
            with httpx.Client(base_url=api, headers=admin, timeout=httpx.Timeout(120, connect=10)) as c:
                with c.stream("GET", f"/api/v1/jobs/{job_id}/logs", params={"follow": "true"}) as resp:
                    assert resp.status_code == 200
                    opened.wait()
                    out.extend(sse(resp.iter_lines()))

        threads = [threading.Thread(target=follow, args=(out,), daemon=True) for out in events]
        for t in threads:
            t.start()
        opened.wait()  # both follows answered 200: their streams are open
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, server_log.read_text()[-3000:]
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        # each follow was told why it ended, not cut off (before: no event, after the shutdown
        # had waited for the follow up to the supervisor's patience)
        assert events == [[("limit", "the server is stopping; follow again")]] * 2
    finally:
        procs.stop()


def test_the_chained_handler_releases_on_the_loop_then_calls_the_one_before():
    """In a fresh interpreter (signal handlers are per process): the handler that was installed
    (uvicorn's, here a stand-in) still runs, after the release was scheduled on the loop; the
    undo puts it back."""
    probe = """
import asyncio, signal
from hai.main import release_waiters_on_signal
calls = []
def before(signum, frame):
    calls.append(("before", signum))
signal.signal(signal.SIGTERM, before)
async def main():
    undo = release_waiters_on_signal(lambda: calls.append(("release", None)))
    assert signal.getsignal(signal.SIGTERM) is not before
    signal.raise_signal(signal.SIGTERM)
    assert calls == [("before", signal.SIGTERM)]  # the release waits for the loop
    while len(calls) < 2:
        await asyncio.sleep(0)
    undo()
    assert signal.getsignal(signal.SIGTERM) is before
asyncio.run(main())
print(calls)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[('before', {int(signal.SIGTERM)}), ('release', None)]"
