"""POST /api/v1/jobs/batch (issue 12): several jobs in one request, all queued in order or none;
the single submission's checks for every job, the queued-jobs limit counted with the batch, and
Idempotency-Key replays of the whole batch."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from hai.db.models import IdempotencyKey, Job, JobEvent
from hai.schemas.jobs import MAX_BATCH_JOBS
from hai.services.scheduling import run_cycle


def _job(name: str, **over) -> dict:
    return {"name": name, "command": ["echo", name], "gpus_per_node": 1} | over


def _post(api, jobs, *, key=None, token=None):
    headers = api.h(token or api.alice) | ({"Idempotency-Key": key} if key is not None else {})
    return api.client.post("/api/v1/jobs/batch", json={"jobs": jobs}, headers=headers)


def _counts(api) -> tuple[int, int, int]:
    with api.platform.sessions() as s:
        return (s.scalar(select(func.count(Job.id))), s.scalar(select(func.count(JobEvent.id))),
                s.scalar(select(func.count(IdempotencyKey.id))))


def test_a_batch_is_queued_in_order_and_each_job_reads_as_a_single_submission(api):
    api.register_node("n0")
    r = _post(api, [_job("a"), _job("b", gpus_per_node=2, priority="HIGH", env={"SEED": "7"}), _job("c")])
    assert r.status_code == 201, r.text
    jobs = r.json()["jobs"]
    assert [j["name"] for j in jobs] == ["a", "b", "c"]
    assert [j["id"] for j in jobs] == sorted(j["id"] for j in jobs)
    assert {j["state"] for j in jobs} == {"queued"} and {j["user"] for j in jobs} == {"alice"}
    assert (jobs[1]["gpus_per_node"], jobs[1]["priority"], jobs[1]["env"]) == (2, "HIGH", {"SEED": "7"})
    # each as GET shows it, and as POST /api/v1/jobs would have answered
    for j in jobs:
        got = api.client.get(f"/api/v1/jobs/{j['id']}", headers=api.h(api.alice)).json()
        assert got == j
    single = api.submit(**_job("d"))
    assert set(single) == set(jobs[0])
    assert [e["reason"] for e in jobs[0]["events"]] == [e["reason"] for e in single["events"]] == ["submitted"]
    assert _counts(api) == (4, 4, 0)


def test_the_scheduler_places_a_batch(api):
    api.register_node("n0")
    r = _post(api, [_job(f"j{i}") for i in range(8)])
    assert r.status_code == 201, r.text
    with api.platform.sessions() as s:
        assert len(run_cycle(s, settings=api.platform.settings).started) == 8


def test_one_job_that_cannot_fit_refuses_the_whole_batch_and_names_it(api):
    api.register_node("n0", gpus=4)
    r = _post(api, [_job("ok"), _job("fits", gpus_per_node=4), _job("too-wide", gpus_per_node=8)])
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", "jobs", 2, "gpus_per_node"]
    assert "job 2" in detail["msg"] and "largest node has 4 GPUs" in detail["msg"]
    r = _post(api, [_job("ok"), _job("two-nodes", nodes=2, gpus_per_node=4)])
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "jobs", 1, "nodes"]
    assert _counts(api) == (0, 0, 0)


def test_a_malformed_job_is_refused_by_validation_and_nothing_is_written(api):
    api.register_node("n0")
    r = _post(api, [_job("ok"), {"name": "bad", "command": []}])
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"][:4] == ["body", "jobs", 1, "command"]
    assert _post(api, []).status_code == 422
    too_many = _post(api, [_job(f"j{i}") for i in range(MAX_BATCH_JOBS + 1)])
    assert too_many.status_code == 422 and too_many.json()["detail"][0]["loc"] == ["body", "jobs"]
    assert _counts(api) == (0, 0, 0)


@pytest.fixture
def limited(settings):
    settings.limits.max_queued_jobs_per_user = 5
    return settings


def test_the_queued_jobs_limit_counts_the_batch(limited, api):
    api.register_node("n0")
    assert _post(api, [_job(f"a{i}") for i in range(3)]).status_code == 201
    r = _post(api, [_job(f"b{i}") for i in range(3)])
    assert r.status_code == 429, r.text
    assert "3 queued job(s) and this batch adds 3" in r.json()["detail"]
    assert _counts(api)[0] == 3
    assert _post(api, [_job(f"c{i}") for i in range(2)]).status_code == 201
    assert _counts(api)[0] == 5


def test_an_idempotency_key_replays_the_whole_batch(api):
    api.register_node("n0")
    jobs = [_job("a"), _job("b"), _job("c")]
    first = _post(api, jobs, key="sweep-1")
    assert first.status_code == 201, first.text
    # the same body with its defaults written out is the same request
    again = _post(api, [j | {"nodes": 1, "env": {}} for j in jobs], key="sweep-1")
    assert again.status_code == 200, again.text
    assert [j["id"] for j in again.json()["jobs"]] == [j["id"] for j in first.json()["jobs"]]
    assert _counts(api) == (3, 3, 3)
    other = _post(api, jobs[:2], key="sweep-1")
    assert other.status_code == 422 and "another request body" in other.json()["detail"][0]["msg"]
    # a single submission with the batch's key is another body too; keys are per user
    single = api.client.post("/api/v1/jobs", json=_job("a"), headers=api.h(api.alice) | {"Idempotency-Key": "sweep-1"})
    assert single.status_code == 422
    assert _post(api, jobs, key="sweep-1", token=api.bob).status_code == 201
    assert _counts(api) == (6, 6, 6)


def test_a_batch_key_is_refused_on_the_header_when_too_long(api):
    api.register_node("n0")
    r = _post(api, [_job("a")], key="x" * 251)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
    assert _counts(api) == (0, 0, 0)


def test_only_users_submit_batches(api):
    api.register_node("n0")
    assert _post(api, [_job("a")], token=api.agent).status_code == 403
    assert api.client.post("/api/v1/jobs/batch", json={"jobs": [_job("a")]}).status_code == 401
    assert _counts(api) == (0, 0, 0)


def test_numbers_that_are_not_finite_are_refused(api):
    """1e400 reads as infinity: a 422 on the field, for a batch and a single submission alike."""
    api.register_node("n0")
    body = '{"jobs": [{"name": "a", "command": ["x"], "gpus_per_node": 1, "max_runtime_s": 1e400}]}'
    r = api.client.post("/api/v1/jobs/batch", content=body,
                        headers=api.h(api.alice) | {"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "jobs", 0, "max_runtime_s"]
    single = '{"name": "a", "command": ["x"], "gpus_per_node": 1, "suspend_grace_s": NaN}'
    r = api.client.post("/api/v1/jobs", content=single, headers=api.h(api.alice) | {"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "suspend_grace_s"]
    assert _counts(api) == (0, 0, 0)
