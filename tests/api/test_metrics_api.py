from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def _samples(text: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_jobs_nodes_and_gpus(api):
    from tests.api.test_agent_protocol_api import cycle

    assert api.client.get("/metrics").status_code == 401
    api.register_node("n0")
    api.submit(gpus_per_node=3)
    api.submit(gpus_per_node=2)
    cancelled = api.submit(gpus_per_node=1)
    api.post(f"/api/v1/jobs/{cancelled['id']}/cancel")
    cycle(api)
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    assert m[("hai_jobs", (("state", "starting"),))] == 2
    assert m[("hai_jobs", (("state", "cancelled"),))] == 1
    assert m[("hai_nodes", (("state", "ready"),))] == 1
    assert m[("hai_gpus_total", ())] == 8
    assert m[("hai_gpus_allocated", ())] == 5
