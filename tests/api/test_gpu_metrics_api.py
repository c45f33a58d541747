"""GPU metrics over time: heartbeats -> per-GPU fine rows and rollups per cluster, node and job;
idle allocated GPUs; usage per user and group; retention; Prometheus; deep links."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select, update

from hai.db.base import utcnow
from hai.db.models import GpuSample, JobAllocation, MetricRollup
from hai.protocol import GpuMetrics, Heartbeat
from hai.services import metrics_store, usage
from tests.api.test_agent_protocol_api import cycle, running


def _gpus(utils: dict[int, float], n: int = 8) -> list[GpuMetrics]:
    return [GpuMetrics(index=i, uuid=f"GPU-{i}", util_pct=utils.get(i, 0.0), memory_used_mib=1000 * i,
                       memory_total_mib=81920, temperature_c=40.0 + i, power_w=100.0) for i in range(n)]


def _beat(api, node: str, utils: dict[int, float], attempts=()):  # noqa: ANN001
    hb = Heartbeat(node=node, gpus=_gpus(utils), attempts=list(attempts))
    r = api.client.post("/api/v1/agent/heartbeat", json=hb.model_dump(mode="json"), headers=api.h(api.agent))
    assert r.status_code == 200, r.text


def _running_job(api, gpus: int = 2) -> tuple[dict, list[int]]:
    api.register_node("n0", zone="A", leaf="A1")
    j = api.submit(gpus_per_node=gpus)
    assert cycle(api).started == [j["id"]]
    placed = api.get(f"/api/v1/jobs/{j['id']}").json()["placement"][0]["gpus"]
    return j, placed


def _flush(api, include_open: bool = True) -> int:  # noqa: ANN001
    with api.platform.sessions() as s:
        return metrics_store.flush(session=s, settings=api.platform.settings, include_open=include_open)


def test_heartbeats_roll_up_per_gpu_node_cluster_and_job(api):
    j, (a, b) = _running_job(api)
    att = [running(j["id"], 1, [0])]
    _beat(api, "n0", {a: 90.0}, att)
    _flush(api)  # an early write of an open bucket: the rest of the bucket is another part
    _beat(api, "n0", {a: 70.0}, att)
    _flush(api)

    with api.platform.sessions() as s:  # one minute bucket unless the two beats straddle a boundary
        buckets = s.scalar(select(func.count(func.distinct(GpuSample.bucket))))
    pts = api.get("/api/v1/cluster/utilisation", params={"window": "hour"}).json()
    assert pts["grain_s"] == api.platform.settings.metrics.fine_s
    n_samples = 16  # 8 GPUs x 2 heartbeats
    if buckets == 1:
        (p,) = pts["points"]
        assert p["util_avg_pct"] == (90 + 70) / n_samples
        assert p["util_max_pct"] == 90
        assert p["busy_pct"] == 100 * 2 / n_samples
    week = api.get("/api/v1/cluster/utilisation", params={"window": "week"}).json()
    assert week["grain_s"] == 900 and sum(p["util_avg_pct"] for p in week["points"]) > 0

    node = api.get("/api/v1/nodes/n0/metrics").json()
    by_gpu = {g["index"]: g["points"] for g in node["gpus"]}
    assert sorted(by_gpu) == list(range(8))
    a_samples = [pt["util_avg_pct"] for pt in by_gpu[a]]
    assert max(pt["util_max_pct"] for pt in by_gpu[a]) == 90 and min(a_samples) >= 70
    assert all(pt["util_avg_pct"] == 0 for pt in by_gpu[b])
    assert api.get("/api/v1/nodes/nope/metrics").status_code == 404

    jm = api.get(f"/api/v1/jobs/{j['id']}/metrics").json()
    assert jm["gpu_samples"] == 4 and jm["busy_samples"] == 2
    assert jm["busy_pct"] == 50.0 and jm["util_avg_pct"] == 40.0
    assert api.get(f"/api/v1/jobs/{j['id']}/metrics", token=api.bob).status_code == 403

    with api.platform.sessions() as s:  # the node's coarse rollup holds the same samples as its GPUs
        rows = s.execute(select(func.sum(MetricRollup.n), func.sum(MetricRollup.util_sum))
                         .where(MetricRollup.scope == "node", MetricRollup.key == "n0", MetricRollup.grain_s == 900)).one()
    assert rows == (16, 160.0)
    nodes = api.get("/api/v1/nodes/n0/metrics").json()["series"]["points"]
    assert sum(p["util_avg_pct"] for p in nodes) > 0 and max(p["util_max_pct"] for p in nodes) == 90


def test_buffered_samples_wait_for_the_flush_interval(api):
    api.platform.settings.metrics.flush_interval_s = 3600
    api.register_node("n0")
    _flush(api)  # start the interval now
    _beat(api, "n0", {0: 50.0})
    with api.platform.sessions() as s:
        assert s.scalar(select(func.count()).select_from(GpuSample)) == 0
    assert _flush(api) == 1  # one row per node and bucket, its 8 GPUs inside
    with api.platform.sessions() as s:
        (row,) = s.scalars(select(GpuSample))
        assert [g[0] for g in row.gpus] == list(range(8)) and row.gpus[0][2] == 50.0


def test_a_bucket_is_written_once_it_has_closed(api):
    settings = api.platform.settings
    settings.metrics.flush_interval_s = 0
    api.register_node("n0")
    t0 = datetime.fromtimestamp(int(utcnow().timestamp()) // 120 * 120, timezone.utc)
    with api.platform.sessions() as s:
        for dt in (1, 30):  # two beats in the first minute: buffered
            metrics_store.record_heartbeat(session=s, node="n0", gpus=_gpus({0: 40.0}), now=t0 + timedelta(seconds=dt),
                                           settings=settings)
        assert s.scalar(select(func.count()).select_from(GpuSample)) == 0
        metrics_store.record_heartbeat(session=s, node="n0", gpus=_gpus({0: 80.0}), now=t0 + timedelta(seconds=121),
                                       settings=settings)
        s.commit()
        (row,) = s.scalars(select(GpuSample))  # the closed minute, once; the open one waits
        assert row.bucket == int(t0.timestamp()) and row.gpus[0][:4] == [0, 2, 80.0, 40.0]


def test_idle_allocated_gpus_are_listed_with_how_long_they_idled(api):
    settings = api.platform.settings
    settings.metrics.idle_after_s = 600
    j, (a, b) = _running_job(api)
    api.post(f"/api/v1/jobs/{j['id']}/cancel", token=api.alice)  # a cancelled job is not "running": not listed
    j2 = api.submit(gpus_per_node=2)
    cycle(api)
    _beat(api, "n0", {}, [running(j2["id"], 1, [0])])  # running now
    placed = api.get(f"/api/v1/jobs/{j2['id']}").json()["placement"][0]["gpus"]
    busy, idle = placed
    t0 = utcnow()
    with api.platform.sessions() as s:
        for dt in (1000, 1600):
            metrics_store.record_heartbeat(session=s, node="n0", gpus=_gpus({busy: 80.0}), now=t0 + timedelta(seconds=dt),
                                           settings=settings)
        metrics_store.flush(session=s, settings=settings)
        listed = metrics_store.idle_allocations(session=s, now=t0 + timedelta(seconds=1700), settings=settings)
    assert [(x.job_id, x.node, x.gpus) for x in listed] == [(j2["id"], "n0", [idle])]
    assert 1700 <= listed[0].idle_s < 1800
    r = api.get("/api/v1/cluster/idle-allocations")
    assert r.status_code == 200 and r.json() == []  # now: nothing idle for 600 s yet


def test_usage_counts_the_gpu_hours_allocations_held(api):
    j, _ = _running_job(api, gpus=2)
    other = api.submit(token=api.bob, gpus_per_node=4)
    cycle(api)
    now = utcnow()
    with api.platform.sessions() as s:
        s.execute(update(JobAllocation).where(JobAllocation.job_id == j["id"])
                  .values(created_at=now - timedelta(hours=2), released_at=now - timedelta(hours=1), active=False))
        s.execute(update(JobAllocation).where(JobAllocation.job_id == other["id"])
                  .values(created_at=now - timedelta(hours=3)))
        s.commit()
        rows = usage.gpu_hours(session=s, by="user", since=now - timedelta(minutes=90), until=now)
    got = {r.key: (round(r.gpu_hours, 3), r.jobs) for r in rows}
    assert got == {"bob": (6.0, 1), "alice": (1.0, 1)}
    r = api.get("/api/v1/usage", params={"by": "group", "since": (now - timedelta(minutes=90)).isoformat(),
                                         "until": now.isoformat()})
    assert r.status_code == 200
    assert {x["key"]: round(x["gpu_hours"], 3) for x in r.json()["rows"]} == {"nlp": 6.0, "vision": 1.0}
    bad = api.get("/api/v1/usage", params={"since": now.isoformat(), "until": (now - timedelta(days=1)).isoformat()})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "since"]
    assert api.get("/api/v1/usage", params={"by": "nobody"}).status_code == 422


def test_quota_use_counts_held_gpus(api):
    r = api.client.put("/api/v1/quotas", json={"items": [{"group": "vision", "priority": "NORMAL", "gpus": 16}]},
                       headers=api.h(api.admin))
    assert r.status_code == 200, r.text
    _running_job(api, gpus=3)
    assert api.get("/api/v1/usage/quotas").json() == [
        {"group": "vision", "priority": "NORMAL", "user": None, "gpus": 16, "used_gpus": 3}]


def test_retention_drops_fine_rows_and_keeps_coarse(api):
    settings = api.platform.settings
    api.register_node("n0")
    with api.platform.sessions() as s:
        metrics_store.record_heartbeat(session=s, node="n0", gpus=_gpus({0: 10.0}), now=utcnow(), settings=settings)
        metrics_store.flush(session=s, settings=settings)
        assert set(s.scalars(select(MetricRollup.grain_s).distinct())) == {settings.metrics.fine_s, 900}
        metrics_store.prune(session=s, settings=settings, now=utcnow() + timedelta(days=3))
        assert s.scalar(select(func.count()).select_from(GpuSample)) == 0
        grains = set(s.scalars(select(MetricRollup.grain_s).distinct()))
        assert grains == {settings.metrics.coarse_s}
        metrics_store.prune(session=s, settings=settings, now=utcnow() + timedelta(days=500))
        assert s.scalar(select(func.count()).select_from(MetricRollup)) == 0


def test_cluster_summary_counts_gpus_allocated_busy_and_queue(api):
    j, (a, _b) = _running_job(api, gpus=2)
    api.submit(gpus_per_node=8, priority="HIGH")
    api.submit(gpus_per_node=8, priority="HIGH")
    _beat(api, "n0", {a: 99.0}, [running(j["id"], 1, [0])])
    s = api.get("/api/v1/cluster/summary").json()
    assert s == {"gpus": 8, "allocated_gpus": 2, "busy_gpus": 1, "running_jobs": 1,
                 "queued_by_priority": {"HIGH": 2}}


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_prometheus_exports_node_gpu_figures_jobs_by_priority_and_queue_wait(api):
    j, (a, _b) = _running_job(api, gpus=2)
    api.submit(gpus_per_node=8, priority="LOW")
    _beat(api, "n0", {a: 80.0}, [running(j["id"], 1, [0])])
    m = _samples(api.get("/metrics").text)
    node = (("leaf", "A1"), ("node", "n0"), ("zone", "A"))
    assert m[("hai_node_gpu_utilization_percent", node)] == 10.0
    assert m[("hai_node_gpu_temperature_max_celsius", node)] == 47.0
    assert m[("hai_node_gpu_power_watts", node)] == 800.0
    assert m[("hai_node_gpu_memory_used_mib", node)] == sum(1000 * i for i in range(8))
    assert m[("hai_jobs_by_priority", (("priority", "NORMAL"), ("state", "running")))] == 1
    assert m[("hai_jobs_by_priority", (("priority", "LOW"), ("state", "queued")))] == 1
    assert m[("hai_queue_wait_max_seconds", (("priority", "LOW"),))] > 0
    assert m[("hai_queue_wait_max_seconds", (("priority", "HIGH"),))] == 0


def test_cluster_nodes_are_light_rows_with_allocation_utilisation_and_jobs(api):
    j, (a, _b) = _running_job(api, gpus=2)
    api.register_node("n1", zone="B", leaf="B1")
    _beat(api, "n0", {a: 80.0}, [running(j["id"], 1, [0])])
    rows = {n["name"]: n for n in api.get("/api/v1/cluster/nodes").json()}
    assert rows["n0"] == {"name": "n0", "zone": "A", "leaf": "A1", "state": "ready", "state_reason": "agent registered", "gpus": 8,
                          "allocated_gpus": 2, "util_pct": 10.0, "jobs": [j["id"]]}
    assert rows["n1"]["util_pct"] is None and rows["n1"]["jobs"] == [] and rows["n1"]["zone"] == "B"
