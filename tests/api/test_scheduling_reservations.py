"""The service stores exactly the reservations of the last cycle: ``Decisions.reservations`` is
the complete set (core.py's contract), so a reservation the scheduler ended is cleared in the
database too, not left for the next cycle to heal."""

from __future__ import annotations

from hai.db.models import Job
from tests.api.test_agent_protocol_api import cycle, heartbeat, running


def stored_reservation(api, job_id: int) -> list[str]:
    with api.platform.sessions() as s:
        return list(s.get(Job, job_id).reserved_nodes or [])


def test_a_reservation_the_scheduler_ended_is_cleared_in_the_database(api):
    api.platform.settings.scheduler.min_runtime_s = 0
    api.register_node("n0", zone="A", leaf="A1")
    low = api.submit(api.bob, name="low", priority="LOW")
    assert cycle(api).started == [low["id"]]
    node = api.get(f"/api/v1/jobs/{low['id']}", api.admin).json()["placement"][0]["node"]
    heartbeat(api, node, [running(low["id"], 1, [0])])

    high = api.submit(api.alice, name="urgent", priority="HIGH")
    assert cycle(api).suspended == [low["id"]]
    assert stored_reservation(api, high["id"]) == [node]

    # the HIGH job's group loses its quota: the scheduler ends the reservation (the job is
    # quota-blocked, it waits for nothing); the stored one must go with it
    r = api.client.put(
        "/api/v1/quotas", json={"items": [{"group": "vision", "priority": "HIGH", "gpus": 0}]}, headers=api.h(api.admin)
    )
    assert r.status_code == 200, r.text
    result = cycle(api)
    assert result.started == [] and result.suspended == []
    waiting = api.get(f"/api/v1/jobs/{high['id']}", api.admin).json()
    assert waiting["state"] == "queued" and "quota" in waiting["pending_reason"]
    assert stored_reservation(api, high["id"]) == []
