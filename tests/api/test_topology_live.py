"""The live platform takes its topology from a file (`hai server --topology FILE`); the file's
labels win over the agents' --zone/--leaf."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hai.services.nodes import load_topology
from tests.conftest import SHARED_DATA


def test_topology_file_defines_nodes_and_wins_over_agent_labels(api, tmp_path):
    path = tmp_path / "topo.csv"
    out = subprocess.run([sys.executable, "-m", "hai.cli.main", "topology", "fire-flyer", "--nodes", "4", "--zones", "2",
                          "--nodes-per-leaf", "2", "--out", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    with api.platform.sessions() as s:
        assert load_topology(session=s, path=path) == 4
    nodes = api.get("/api/v1/nodes").json()
    assert len(nodes) == 4 and {n["state"] for n in nodes} == {"lost"}  # no agent yet: nothing runs there
    first = nodes[0]
    api.register_node(first["name"], zone="elsewhere", leaf="nowhere")
    again = {n["name"]: n for n in api.get("/api/v1/nodes").json()}[first["name"]]
    assert (again["zone"], again["leaf"], again["state"]) == (first["zone"], first["leaf"], "ready")


@pytest.mark.skipif(not (SHARED_DATA / "crux_topology.csv").exists(), reason="shared data not present")
def test_crux_topology_loads_as_real_irregular_clos(api, tmp_path):
    path = tmp_path / "crux.csv"
    out = subprocess.run([sys.executable, "-m", "hai.cli.main", "topology", "from-crux",
                          str(SHARED_DATA / "crux_topology.csv"), "--out", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    with api.platform.sessions() as s:
        assert load_topology(session=s, path=path) == 847
    import csv

    with (SHARED_DATA / "crux_topology.csv").open() as f:
        rows = list(csv.DictReader(f))
    nodes = api.get("/api/v1/nodes").json()
    assert len(nodes) == len(rows) == 847 and all(n["gpus"] == 8 for n in nodes)
    assert {n["zone"] for n in nodes} == {r["DSW"] for r in rows}  # zone = core switch group
    assert {n["leaf"] for n in nodes} == {r["ASW"] for r in rows}  # leaf = ToR switch


def test_topology_file_missing_columns_is_refused(api, tmp_path):
    import pytest

    from hai.services.errors import Invalid

    bad = tmp_path / "bad.csv"
    bad.write_text("node,gpus\nn1,8\n")
    with api.platform.sessions() as s, pytest.raises(Invalid, match="leaf, zone"):
        load_topology(session=s, path=bad)
    assert api.get("/api/v1/nodes").json() == []
