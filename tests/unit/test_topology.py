"""Topology files: the Fire-Flyer generator, the Crux converter, CSV parsing."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from hai.domain.topology import (
    TopologyError,
    TopologyNode,
    fire_flyer,
    format_topology_csv,
    from_crux,
    parse_topology_csv,
    summarize,
)

CRUX = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "crux_topology.csv"


def test_fire_flyer_defaults_are_the_papers_shape():
    nodes = fire_flyer()
    assert len(nodes) == 1250
    s = summarize(nodes)
    assert list(s) == ["A", "B"]
    assert s["A"] == {"nodes": 625, "gpus": 5000, "leaves": 32}  # 31 leaves of 20 + one of 5
    assert s["B"] == {"nodes": 625, "gpus": 5000, "leaves": 32}
    assert len({n.name for n in nodes}) == 1250
    per_leaf: dict[str, int] = {}
    for n in nodes:
        per_leaf[n.leaf] = per_leaf.get(n.leaf, 0) + 1
        assert n.leaf.startswith(n.zone + "-")
    assert max(per_leaf.values()) == 20


@pytest.mark.parametrize(
    "kw, zones, sizes",
    [
        (dict(nodes=64, zones=2, nodes_per_leaf=8), ["A", "B"], {"A": 32, "B": 32}),
        (dict(nodes=5, zones=2, nodes_per_leaf=2), ["A", "B"], {"A": 3, "B": 2}),
        (dict(nodes=3, zones=1, nodes_per_leaf=20), ["A"], {"A": 3}),
    ],
)
def test_fire_flyer_splits_nodes_over_zones(kw, zones, sizes):
    s = summarize(fire_flyer(**kw))
    assert list(s) == zones
    assert {z: v["nodes"] for z, v in s.items()} == sizes


@pytest.mark.parametrize("kw", [dict(nodes=0), dict(zones=0), dict(nodes=2, zones=3), dict(nodes_per_leaf=0)])
def test_fire_flyer_rejects_impossible_shapes(kw):
    with pytest.raises(TopologyError):
        fire_flyer(**kw)


def test_csv_round_trip():
    nodes = fire_flyer(nodes=10, zones=2, nodes_per_leaf=3)
    text = format_topology_csv(nodes)
    assert text.splitlines()[0] == "node,gpus,leaf,zone"
    assert parse_topology_csv(text) == nodes


def test_parse_ignores_extra_columns():
    text = "zone,node,leaf,gpus,rack\nA,n1,l1,8,r9\nB,n2,l2,4,r9\n"
    assert parse_topology_csv(text) == [TopologyNode("n1", 8, "l1", "A"), TopologyNode("n2", 4, "l2", "B")]


@pytest.mark.parametrize(
    "text, message",
    [
        ("node,gpus,leaf\nn1,8,l1\n", r"lacks column\(s\) zone"),
        ("node,gpus,leaf,zone\nn1,8,l1,A\nn1,8,l1,A\n", "listed twice"),
        ("node,gpus,leaf,zone\nn1,eight,l1,A\n", "gpus must be an integer"),
        ("node,gpus,leaf,zone\nn1,0,l1,A\n", "has 0 GPUs"),
        ("node,gpus,leaf,zone\nn1,8,,A\n", "needs a leaf and a zone"),
        ("node,gpus,leaf,zone\n", "no nodes"),
    ],
)
def test_parse_errors_say_what_is_wrong(text, message):
    with pytest.raises(TopologyError, match=message):
        parse_topology_csv(text)


def test_from_crux_maps_dsw_to_zone_and_asw_to_leaf():
    rows = [
        {"ip": "f" * 64, "DSW": "G2", "PSW": "P1", "ASW": "S9"},
        {"ip": "a" * 64, "DSW": "G1", "PSW": "P1", "ASW": "S1"},
        {"ip": "a" * 13 + "b" * 51, "DSW": "G1", "PSW": "P2", "ASW": "S1"},
    ]
    nodes = from_crux(rows)
    assert [(n.zone, n.leaf, n.gpus) for n in nodes] == [("G1", "S1", 8), ("G1", "S1", 8), ("G2", "S9", 8)]
    # names: the shortest prefix (12, 16, ...) that keeps them unique
    assert [n.name for n in nodes] == ["a" * 16, "a" * 13 + "bbb", "f" * 16]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"ip": "x", "DSW": "G1"}], "lacks column 'ASW'"),
        ([{"ip": "x", "DSW": "G1", "ASW": ""}], "empty"),
        ([{"ip": "x", "DSW": "G1", "ASW": "S1"}, {"ip": "x", "DSW": "G1", "ASW": "S1"}], "twice"),
        ([], "no hosts"),
    ],
)
def test_from_crux_errors(rows, message):
    with pytest.raises(TopologyError, match=message):
        from_crux(rows)


@pytest.mark.skipif(not CRUX.exists(), reason="shared data not present")
def test_from_crux_on_the_real_lingjun_topology():
    nodes = from_crux(csv.DictReader(io.StringIO(CRUX.read_text())))
    s = summarize(nodes)
    assert len(nodes) == 847
    assert list(s) == ["G6"]
    assert s["G6"]["leaves"] == 48
    sizes: dict[str, int] = {}
    for n in nodes:
        sizes[n.leaf] = sizes.get(n.leaf, 0) + 1
    assert min(sizes.values()) == 3 and max(sizes.values()) == 24  # uneven leaves, as in the paper's data
