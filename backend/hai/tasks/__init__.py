"""Celery app and thin tasks: ids in, open their own session, call a service, done.

Run with ``celery -A hai.tasks worker --beat``. The broker is HAI_REDIS__URL.
"""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache

from celery import Celery

from hai.settings import get_settings


class HaiCelery(Celery):
    """Reads its broker from settings when first configured, not at import time."""

    def on_configure(self) -> None:
        settings = get_settings()
        url = settings.redis.url or "redis://127.0.0.1:6379/0"
        self.conf.update(
            broker_url=url,
            result_backend=url,
            task_acks_late=True,
            task_reject_on_worker_lost=True,
            broker_connection_retry_on_startup=True,
            beat_schedule={
                "reap-lost-nodes": {"task": "hai.tasks.reap_lost_nodes", "schedule": 10.0},
                "prune-logs": {"task": "hai.tasks.prune_logs", "schedule": 3600.0},
                "validate-nodes": {"task": "hai.tasks.validate_nodes", "schedule": settings.validation.full_every_s},
                "prune-metrics": {"task": "hai.tasks.prune_metrics", "schedule": 3600.0},
            },
        )


app = HaiCelery("hai")


@lru_cache
def _platform():  # one per worker process, built on first use
    from hai.services.context import Platform

    return Platform.from_settings(get_settings())


@app.task(name="hai.tasks.reap_lost_nodes")
def reap_lost_nodes() -> list[str]:
    from hai.services.node_health import expire_runs
    from hai.services.reaper import mark_lost_nodes

    platform = _platform()
    with platform.sessions() as session:
        lost = mark_lost_nodes(session=session, settings=platform.settings)
    with platform.sessions() as session:
        expire_runs(session=session, settings=platform.settings)
    return lost


@app.task(name="hai.tasks.validate_nodes")
def validate_nodes() -> list[int]:
    """The scheduled full validator round (validation.full_every_s; weekly by default)."""
    from hai.services.node_health import schedule_full_round

    platform = _platform()
    with platform.sessions() as session:
        return schedule_full_round(session=session, settings=platform.settings)


@app.task(name="hai.tasks.prune_logs")
def prune_logs(retention_days: int | None = None) -> int:
    from hai.services.retention import prune_finished_job_logs

    platform = _platform()
    days = retention_days if retention_days is not None else platform.settings.log_retention_days
    with platform.sessions() as session:
        return prune_finished_job_logs(session=session, older_than=timedelta(days=days))


@app.task(name="hai.tasks.prune_metrics")
def prune_metrics() -> int:
    from hai.db.base import utcnow
    from hai.services.metrics_store import prune

    platform = _platform()
    with platform.sessions() as session:
        return prune(session=session, settings=platform.settings, now=utcnow())
