"""How many nodes have each GPU count, kept by the database (issue 12, migration 0020): triggers on
``nodes`` keep ``node_sizes`` whoever writes (a registration, a re-registration with fewer GPUs,
raw SQL), and a submission's admission check (enough nodes, a node large enough, enough whole
nodes of the job's size) reads it instead of aggregating every node. The kept counts must equal
a count of the nodes after every kind of write, and the admission must follow them at once; on
SQLite and PostgreSQL, schemas from the migrations and from ``create_all``."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text

from hai.db.migrate import downgrade, upgrade
from tests.conftest import Api, api_with_two_nodes

_NODE = ("INSERT INTO nodes (name, zone, leaf, gpus, state, address, fake_gpus, gpu_inventory, gpu_metrics, nics,"
         " agent_version, protocol_version, registered_at, state_reason, labels_from_topology, heartbeats_since_quick)"
         " VALUES (:n, 'A', 'A1', :g, 'ready', '127.0.0.1', true, '[]', '[]', '[]', '', 1, CURRENT_TIMESTAMP, '', false, 0)")


def _url(request, tmp_path) -> str:  # noqa: ANN001
    return f"sqlite:///{tmp_path / 'hai.db'}" if request.param.startswith("sqlite") else request.getfixturevalue("pg_url")


@pytest.fixture(params=["sqlite", "postgresql", "sqlite-create_all", "postgresql-create_all"])
def api(request, tmp_path):
    """An Api with two 8-GPU nodes registered by their agents."""
    with api_with_two_nodes(_url(request, tmp_path), tmp_path, create_all=request.param.endswith("create_all")) as a:
        yield a


def _raw(api: Api, sql: str, **params) -> None:
    with api.platform.sessions() as s:
        s.execute(text(sql), params)
        s.commit()


def _same(api: Api) -> dict[int, int]:
    """The kept counts equal a count of the nodes by GPU count; returns them."""
    with api.platform.read_sessions() as s:
        kept = {g: n for g, n in s.execute(text("SELECT gpus, nodes FROM node_sizes")) if n}
        counted = dict(s.execute(text("SELECT gpus, count(*) FROM nodes GROUP BY gpus")).all())
    assert kept == counted
    return kept


def _refused(api: Api, **body) -> tuple[str, str]:
    r = api.post("/api/v1/jobs", json={"name": "j", "command": ["true"], **body})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    return detail["loc"][-1], detail["msg"]


def test_the_kept_sizes_follow_registrations_and_raw_writes(api):
    assert _same(api) == {8: 2}
    api.register_node("n2", gpus=4)
    assert _same(api) == {8: 2, 4: 1}
    api.register_node("n0", gpus=4)  # re-registered with four GPUs fewer (a GPU lost from the bus)
    assert _same(api) == {8: 1, 4: 2}
    api.register_node("n0", gpus=4)  # again, unchanged: nothing moves
    assert _same(api) == {8: 1, 4: 2}
    _raw(api, "UPDATE nodes SET state = 'draining', gpu_util_pct = 50, gpus_busy = 3")  # not the size
    assert _same(api) == {8: 1, 4: 2}
    _raw(api, _NODE, n="raw", g=2)
    _raw(api, "UPDATE nodes SET gpus = 8 WHERE name = 'n2'")
    assert _same(api) == {8: 2, 4: 1, 2: 1}
    _raw(api, "DELETE FROM nodes WHERE gpus = 8")
    assert _same(api) == {4: 1, 2: 1}
    _raw(api, "DELETE FROM nodes")
    assert _same(api) == {}


def test_a_rolled_back_write_leaves_the_kept_sizes_as_they_were(api):
    with api.platform.sessions() as s:
        s.execute(text(_NODE), {"n": "gone", "g": 8})
        s.execute(text("UPDATE nodes SET gpus = 1 WHERE name = 'n0'"))
        s.rollback()
    assert _same(api) == {8: 2}


def test_the_admission_follows_the_kept_sizes_at_once(api):
    assert _refused(api, nodes=3, gpus_per_node=8) == ("nodes", "the cluster has 2 node(s); the job asks for 3")
    _raw(api, _NODE, n="n2", g=8)
    assert api.submit(nodes=3, gpus_per_node=8)["state"] == "queued"
    _raw(api, "UPDATE nodes SET gpus = 4")
    assert _refused(api, nodes=1, gpus_per_node=8) == (
        "gpus_per_node", "the largest node has 4 GPUs; the job asks for 8")
    assert api.submit(nodes=3, gpus_per_node=4)["state"] == "queued"
    _raw(api, "UPDATE nodes SET gpus = 8 WHERE name = 'n2'")
    assert api.submit(nodes=1, gpus_per_node=8)["state"] == "queued"
    # more than one node takes whole nodes: two of 4 GPUs are left, and one of 8
    assert api.submit(nodes=2, gpus_per_node=4)["state"] == "queued"
    loc, msg = _refused(api, nodes=3, gpus_per_node=4)
    assert loc == "gpus_per_node" and "the cluster has 2 node(s) of 4 GPUs (node sizes: 4, 8)" in msg
    _raw(api, "DELETE FROM nodes WHERE gpus = 8")
    assert _refused(api, nodes=1, gpus_per_node=8)[0] == "gpus_per_node"
    _raw(api, "DELETE FROM nodes")
    assert _refused(api, nodes=1, gpus_per_node=1) == ("nodes", "the cluster has 0 node(s); the job asks for 1")


def test_the_admission_reads_the_kept_rows_not_the_nodes(api):
    """What makes it cheap: the nodes' rows are not read. A kept count set apart from the nodes
    by hand (no writer can: the triggers keep them together) is what the admission sees."""
    _raw(api, "UPDATE node_sizes SET nodes = 5 WHERE gpus = 8")
    assert api.submit(nodes=5, gpus_per_node=8)["state"] == "queued"
    for path, body in (("/api/v1/jobs", {"name": "j", "command": ["true"], "nodes": 6, "gpus_per_node": 8}),
                       ("/api/v1/jobs/batch", {"jobs": [{"name": "j", "command": ["true"], "nodes": 6, "gpus_per_node": 8}]})):
        r = api.post(path, json=body)
        assert r.status_code == 422 and "the cluster has 5 node(s)" in r.text, r.text


def test_a_batch_is_admitted_on_the_kept_sizes(api):
    jobs = [{"name": f"b{i}", "command": ["true"], "nodes": 2, "gpus_per_node": 8} for i in range(2)]
    r = api.post("/api/v1/jobs/batch", json={"jobs": jobs})
    assert r.status_code == 201, r.text
    _raw(api, "DELETE FROM nodes WHERE name = 'n1'")
    r = api.post("/api/v1/jobs/batch", json={"jobs": jobs})
    assert r.status_code == 422, r.text


@pytest.fixture(params=["sqlite", "postgresql"])
def bare_url(request, tmp_path):
    return _url(request, tmp_path)


def test_the_upgrade_counts_the_nodes_already_there_and_the_downgrade_removes_it(bare_url):
    upgrade(bare_url, "0019")
    engine = create_engine(bare_url)
    with engine.begin() as c:
        for name, gpus in (("a", 8), ("b", 8), ("c", 4)):
            c.execute(text(_NODE), {"n": name, "g": gpus})
    upgrade(bare_url)
    sizes = text("SELECT gpus, nodes FROM node_sizes WHERE nodes > 0")
    with engine.begin() as c:
        assert dict(c.execute(sizes).all()) == {8: 2, 4: 1}
        c.execute(text("DELETE FROM nodes WHERE name = 'c'"))
        c.execute(text(_NODE), {"n": "d", "g": 2})
        assert dict(c.execute(sizes).all()) == {8: 2, 2: 1}
    engine.dispose()
    downgrade(bare_url, "0019")
    engine = create_engine(bare_url)
    with engine.begin() as c:
        tables = {r[0] for r in c.execute(text(
            "SELECT name FROM sqlite_master WHERE type = 'table'" if bare_url.startswith("sqlite")
            else "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"))}
        c.execute(text(_NODE), {"n": "e", "g": 8})  # no trigger left to write to a missing table
        assert c.execute(text("SELECT count(*) FROM nodes")).scalar() == 4
    engine.dispose()
    assert "node_sizes" not in tables and "nodes" in tables
