"""Prometheus metrics (prometheus-client): formats what services.monitoring reads at scrape time."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from hai.api.deps import CurrentUser, PlatformDep
from hai.db.base import utcnow
from hai.domain.jobs import JobState, Priority
from hai.domain.nodes import NodeState
from hai.services import monitoring
from hai.services.context import Platform

router = APIRouter(tags=["metrics"])


class _ClusterCollector:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def collect(self):  # noqa: ANN201
        with self.platform.sessions() as s:
            g = monitoring.cluster_gauges(session=s, now=utcnow())
        j = GaugeMetricFamily("hai_jobs", "jobs by state", labels=["state"])
        jp = GaugeMetricFamily("hai_jobs_by_priority", "jobs by state and priority", labels=["state", "priority"])
        for state in JobState:
            j.add_metric([state.value], sum(c for (s_, _p), c in g.jobs.items() if s_ == state.value))
            for prio in Priority:
                jp.add_metric([state.value, prio.value], g.jobs.get((state.value, prio.value), 0))
        yield j
        yield jp
        n = GaugeMetricFamily("hai_nodes", "nodes by state", labels=["state"])
        for state in NodeState:
            n.add_metric([state.value], g.nodes.get(state.value, 0))
        yield n
        yield GaugeMetricFamily("hai_gpus_total", "GPUs on ready nodes", value=g.gpus_ready)
        yield GaugeMetricFamily("hai_gpus_allocated", "GPUs held by jobs", value=g.gpus_allocated)
        wmax = GaugeMetricFamily("hai_queue_wait_max_seconds", "the longest wait of a queued job", labels=["priority"])
        wavg = GaugeMetricFamily("hai_queue_wait_avg_seconds", "the mean wait of queued jobs", labels=["priority"])
        for prio in Priority:
            wmax.add_metric([prio.value], g.queue_wait_max_s.get(prio.value, 0.0))
            wavg.add_metric([prio.value], g.queue_wait_avg_s.get(prio.value, 0.0))
        yield wmax
        yield wavg
        labels = ["node", "zone", "leaf"]
        util = GaugeMetricFamily("hai_node_gpu_utilization_percent", "mean GPU utilisation of a node", labels=labels)
        mem = GaugeMetricFamily("hai_node_gpu_memory_used_mib", "GPU memory used on a node", labels=labels)
        memt = GaugeMetricFamily("hai_node_gpu_memory_total_mib", "GPU memory of a node", labels=labels)
        temp = GaugeMetricFamily("hai_node_gpu_temperature_max_celsius", "hottest GPU of a node", labels=labels)
        power = GaugeMetricFamily("hai_node_gpu_power_watts", "GPU power draw of a node", labels=labels)
        for ng in g.node_gauges:
            key = [ng.name, ng.zone, ng.leaf]
            if ng.util_pct is not None:
                util.add_metric(key, ng.util_pct)
            mem.add_metric(key, ng.memory_used_mib)
            memt.add_metric(key, ng.memory_total_mib)
            if ng.temperature_max_c is not None:
                temp.add_metric(key, ng.temperature_max_c)
            if ng.power_w is not None:
                power.add_metric(key, ng.power_w)
        yield from (util, mem, memt, temp, power)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(platform: PlatformDep, _user: CurrentUser) -> Response:
    """Prometheus text format (scrape with a bearer token)."""
    registry = CollectorRegistry()
    registry.register(_ClusterCollector(platform))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
