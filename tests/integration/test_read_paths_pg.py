"""The read paths of issue 12 on SQLite and PostgreSQL (the API tests run on SQLite only): the job
list's bounded count, its page assembled from column rows (events, latest attempt's placement
with node labels, masked environments), and the node list's aggregate of the active allocations
(free GPUs, running jobs, per-GPU figures only when asked)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hai.db.models import Job, JobAllocation, JobEvent, Node, User
from hai.domain.jobs import JobState
from hai.services import job_views
from hai.services import nodes as node_service
from hai.services.auth import Principal
from hai.services.job_views import CountMode, job_list_page, list_jobs


def _seed(s, now: datetime) -> None:  # noqa: ANN001
    s.add_all([User(id=1, name="alice", group="g"), User(id=2, name="bob", group="g")])
    s.add_all([Node(name="n0", zone="A", leaf="A1", gpus=8, gpu_util_pct=40.0, gpus_busy=2,
                    gpu_inventory=[{"index": i, "uuid": f"G{i}", "model": "A100"} for i in range(8)],
                    gpu_metrics=[{"index": 0, "util_pct": 80.0}]),
               Node(name="n1", zone="B", leaf="B1", gpus=8)])
    s.flush()
    for i in range(1, 7):  # jobs 1-6: alice's odd, bob's even; 5 and 6 running
        state = "running" if i >= 5 else "queued"
        s.add(Job(id=i, name=f"j{i}", user_id=1 if i % 2 else 2, user_name="alice" if i % 2 else "bob", group="g",
                  command=["x"], env={"TOKEN": f"secret{i}"}, state=state, attempt=2 if i == 5 else (1 if i == 6 else 0),
                  created_at=now + timedelta(seconds=i)))
    s.flush()
    s.add_all([JobEvent(job_id=5, at=now, to_state="queued", reason="submitted"),
               JobEvent(job_id=5, at=now + timedelta(seconds=1), from_state="queued", to_state="starting",
                        reason="placed")])
    s.add_all([
        # job 5's first attempt ran on n1 (released), its second on n0 and n1
        JobAllocation(job_id=5, attempt=1, node_name="n1", node_rank=0, gpus=[0, 1, 2, 3], active=False),
        JobAllocation(job_id=5, attempt=2, node_name="n0", node_rank=0, gpus=[0, 1, 2, 3]),
        JobAllocation(job_id=5, attempt=2, node_name="n1", node_rank=1, gpus=[4, 5]),
        JobAllocation(job_id=6, attempt=1, node_name="n0", node_rank=0, gpus=[6]),
    ])
    s.commit()


def test_job_list_counts_only_as_far_as_is_cheap(sessions, monkeypatch):
    now = datetime.now(timezone.utc)
    with sessions() as s:
        _seed(s, now)
        monkeypatch.setattr(job_views, "COUNT_CAP", 3)
        page = list_jobs(session=s, limit=2)
        assert [r["id"] for r in page.rows] == [6, 5] and (page.total, page.total_exact) == (3, False)
        exact = list_jobs(session=s, limit=2, count=CountMode.EXACT)
        assert (exact.total, exact.total_exact) == (6, True)
        # a filter with at most the cap: exact; the last page shows its own total
        assert (lambda p: (p.total, p.total_exact))(list_jobs(session=s, limit=1, state=[JobState.RUNNING])) == (2, True)
        assert (lambda p: (p.total, p.total_exact))(list_jobs(session=s, limit=50, user_name="bob")) == (3, True)
        # a page deeper than the cap: the total is at least what the page shows
        deep = list_jobs(session=s, limit=2, offset=3)
        assert [r["id"] for r in deep.rows] == [3, 2] and (deep.total, deep.total_exact) == (5, False)
        # keyset pages count the whole filter, not only below before_id
        below = list_jobs(session=s, limit=2, before_id=3)
        assert [r["id"] for r in below.rows] == [2, 1] and (below.total, below.total_exact) == (3, False)
        monkeypatch.setattr(job_views, "COUNT_CAP", 10)
        assert (lambda p: (p.total, p.total_exact))(list_jobs(session=s, limit=2, before_id=3)) == (6, True)


def test_job_list_offset_pages_are_slices_of_the_list(sessions):
    """Deep pages read the offset's ids first (the index only), then the page's rows: the same
    jobs, newest first, as slicing the whole filtered list, with filters and below ``before_id``."""
    now = datetime.now(timezone.utc)
    with sessions() as s:
        _seed(s, now)
        for kw in ({}, {"user_name": "alice"}, {"state": [JobState.QUEUED]},
                   {"user_name": "bob", "state": [JobState.QUEUED]}, {"before_id": 5}, {"before_id": 6, "user_name": "bob"}):
            whole = [r["id"] for r in list_jobs(session=s, limit=50, **kw).rows]
            for offset in range(len(whole) + 1):
                page = list_jobs(session=s, limit=2, offset=offset, **kw)
                assert [r["id"] for r in page.rows] == whole[offset:offset + 2], (kw, offset)
                assert all(set(r.keys()) >= {"id", "name", "env", "user_id"} for r in page.rows)
        assert [r["id"] for r in list_jobs(session=s, limit=2, offset=1, user_name="alice").rows] == [3, 1]


def test_job_list_page_reads_events_placement_and_masks(sessions):
    now = datetime.now(timezone.utc)
    with sessions() as s:
        _seed(s, now)
        alice = Principal(kind="user", user_id=1, name="alice")
        out = job_list_page(session=s, page=list_jobs(session=s, limit=50), viewer=alice)
        by_id = {j.id: j for j in out.items}
        assert [j.id for j in out.items] == [6, 5, 4, 3, 2, 1] and (out.total, out.total_exact) == (6, True)
        j5 = by_id[5]
        assert [(p.node, p.zone, p.leaf, p.gpus) for p in j5.placement] == [
            ("n0", "A", "A1", [0, 1, 2, 3]), ("n1", "B", "B1", [4, 5])]  # the latest attempt's only
        assert [(e.from_state, e.to_state, e.reason) for e in j5.events] == [
            (None, "queued", "submitted"), ("queued", "starting", "placed")]
        assert by_id[5].env == {"TOKEN": "secret5"} and by_id[6].env == {"TOKEN": "***"}  # bob's, masked
        assert by_id[4].placement == [] and by_id[4].events == []
        admin = Principal(kind="user", user_id=99, name="root", is_admin=True)
        assert job_list_page(session=s, page=list_jobs(session=s), viewer=admin).items[0].env == {"TOKEN": "secret6"}


def test_node_list_aggregates_active_allocations(sessions):
    now = datetime.now(timezone.utc)
    with sessions() as s:
        _seed(s, now)
        rows = {r["name"]: r for r in node_service.list_nodes(session=s)}
        assert (rows["n0"]["free_gpus"], rows["n0"]["running_jobs"]) == (3, [5, 6])
        assert (rows["n1"]["free_gpus"], rows["n1"]["running_jobs"]) == (6, [5])  # attempt 1's GPUs released
        assert (rows["n0"]["gpu_util_pct"], rows["n0"]["gpus_busy"]) == (40.0, 2)
        assert rows["n0"]["gpu_metrics"] is None
        full = {r["name"]: r for r in node_service.list_nodes(session=s, gpu_metrics=True)}
        assert full["n0"]["gpu_metrics"][0] == {"index": 0, "uuid": "G0", "model": "A100", "util_pct": 80.0}
        assert [g["index"] for g in full["n0"]["gpu_metrics"]] == list(range(8)) and full["n1"]["gpu_metrics"] == []


def test_node_list_document_is_the_serialised_rows(sessions):
    """The light node list as served (on PostgreSQL written by the database in one statement):
    byte for byte pydantic-core's serialisation of list_nodes' rows, and equal to the
    model-validated list, with the values whose text forms differ between PostgreSQL and Python:
    escaped strings, datetimes with and without microseconds, integral and repeating floats."""
    from pydantic_core import to_json

    from hai.schemas.common import NodeRead

    now = datetime(2026, 12, 2, 11, 0, 0, tzinfo=timezone.utc)
    with sessions() as s:
        _seed(s, now)
        n0 = s.query(Node).filter_by(name="n0").one()
        n0.last_heartbeat_at = now  # no microseconds: "...T11:00:00Z"
        n0.state_reason = 'disk "full" \\ tab\there\nline \x01 é 😀'
        s.add_all([
            Node(name="a-first-by-name", zone="Z", leaf="Z1", gpus=4, fake_gpus=True, gpu_util_pct=100 / 3,
                 gpus_busy=1, last_heartbeat_at=now + timedelta(microseconds=123450), address="10.0.0.7"),
            Node(name="m", zone="A", leaf="A0", gpus=2, gpu_util_pct=0.1 + 0.2, state="draining",
                 last_heartbeat_at=now - timedelta(days=400, microseconds=1)),
            Node(name="tiny", zone="A", leaf="A0", gpus=1, gpu_util_pct=1.5e-7),
            Node(name="zero", zone="A", leaf="A1", gpus=1, gpu_util_pct=0.0),
        ])
        # job 4's allocation inserted after jobs 5 and 6 on n0: the list sorts the ids
        s.add(JobAllocation(job_id=4, attempt=1, node_name="n0", node_rank=0, gpus=[7]))
        s.commit()
        served = node_service.list_nodes_json(session=s)
        assert served == to_json(node_service.list_nodes(session=s))
        nodes = __import__("json").loads(served)
        assert nodes == [NodeRead.model_validate(n).model_dump(mode="json") for n in nodes]
        assert [n["name"] for n in nodes] == ["m", "tiny", "n0", "zero", "n1", "a-first-by-name"]
        by = {n["name"]: n for n in nodes}
        assert (by["n0"]["free_gpus"], by["n0"]["running_jobs"]) == (2, [4, 5, 6])
        assert by["n0"]["last_heartbeat_at"] == "2026-12-02T11:00:00Z"
        assert by["n0"]["state_reason"] == 'disk "full" \\ tab\there\nline \x01 é 😀'
        assert by["a-first-by-name"]["last_heartbeat_at"] == "2026-12-02T11:00:00.123450Z"
        assert by["a-first-by-name"]["gpu_util_pct"] == 100 / 3 and by["m"]["gpu_util_pct"] == 0.1 + 0.2
        assert b'"gpu_util_pct":0.0,' in served and b'"gpu_util_pct":40.0,' in served
        assert b'"gpu_util_pct":1.5e-7,' in served
        assert (by["n1"]["last_heartbeat_at"], by["n1"]["gpu_util_pct"], by["n1"]["running_jobs"]) == (None, None, [5])
        s.execute(JobAllocation.__table__.delete())
        s.execute(Node.__table__.delete().where(Node.name != "n1"))
        s.commit()
        assert node_service.list_nodes_json(session=s) == to_json(node_service.list_nodes(session=s))
        s.execute(Node.__table__.delete())
        s.commit()
        assert node_service.list_nodes_json(session=s) == b"[]"


def test_job_list_document_is_the_validated_models_document(sessions):
    """The job list as served (``job_list_json``, written without validating the page) is byte for
    byte the validated models' JSON: every state and nullable field, events and placements, a
    masked environment, and the two free-form documents with ints where floats are declared,
    optional keys missing and keys the models do not have."""
    now = datetime.now(timezone.utc)
    with sessions() as s:
        _seed(s, now)
        j3 = s.get(Job, 3)
        j3.state, j3.exit_code, j3.failure_reason = "failed", 7, "exit code 7"
        j3.started_at, j3.finished_at = now + timedelta(seconds=4.25), now + timedelta(seconds=90)
        j3.tags, j3.max_runtime_s, j3.lost_gpu_s, j3.pending_reason = ["a", "b"], 3600, 12.5, None
        j3.last_checkpoint = {"path": "/ck/3", "at": 1700000000, "extra": True}  # an int for a float, no step
        j3.progress = {"step": 5, "at": 1700000001.5, "metrics": {"loss": 1, "acc": 0.25}, "total": None}
        s.get(Job, 4).progress = {"step": 2.0, "at": 17}  # a float step, no metrics
        s.commit()
        for viewer in (Principal(kind="user", user_id=1, name="alice"),
                       Principal(kind="user", user_id=99, name="root", is_admin=True), None):
            for kw in ({"limit": 50}, {"limit": 2, "offset": 1}, {"state": [JobState.RUNNING]}):
                page = list_jobs(session=s, **kw)
                expected = job_list_page(session=s, page=page, viewer=viewer).model_dump_json().encode()
                assert job_views.job_list_json(session=s, page=page, viewer=viewer) == expected, (viewer, kw)
        doc = job_views.job_list_json(session=s, page=list_jobs(session=s), viewer=None)
        assert b'"last_checkpoint":{"path":"/ck/3","step":null,"at":1700000000.0,"duration_s":null}' in doc
        assert b'"metrics":{"loss":1.0,"acc":0.25}' in doc and b'"step":2,' in doc
