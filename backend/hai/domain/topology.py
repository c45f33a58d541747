"""Cluster topology: zones of two-layer fat-trees, leaf switches, GPU nodes.

A topology file is CSV with the header ``node,gpus,leaf,zone`` (one row per node; extra
columns are ignored). Two generators produce one:

* :func:`fire_flyer` - the Fire-Flyer 2 shape (arXiv:2408.14158): two zones, each a two-layer
  fat-tree whose leaf switches connect 20 nodes of 8 GPUs;
* :func:`from_crux` - converts the Alibaba Lingjun / Crux 3-tier Clos topology
  (``ip,DSW,PSW,ASW``): zone = DSW (core group), leaf = ASW (ToR switch), 8 GPUs a node.

Pure code: stdlib only. Parsing works on text or rows, never on open files or paths, so the
CLI owns all I/O.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TOPOLOGY_COLUMNS = ("node", "gpus", "leaf", "zone")


class TopologyError(ValueError):
    """A topology file or generator argument that cannot describe a cluster."""


@dataclass(frozen=True)
class TopologyNode:
    name: str
    gpus: int
    leaf: str
    zone: str


def _zone_name(index: int) -> str:
    # A, B, ..., Z, AA, AB, ... (spreadsheet-style, so zone names sort like their indices for <= 26)
    name = ""
    index += 1
    while index:
        index, rem = divmod(index - 1, 26)
        name = chr(ord("A") + rem) + name
    return name


def fire_flyer(
    nodes: int = 1250, zones: int = 2, nodes_per_leaf: int = 20, gpus_per_node: int = 8
) -> list[TopologyNode]:
    """The paper's shape: ``nodes`` split as evenly as possible over ``zones``; inside a zone,
    consecutive nodes share a leaf switch, ``nodes_per_leaf`` at a time (the last leaf of a zone
    may be smaller). Names are stable: ``ff-<zone>-<leaf:02>-<n:02>``, zone ``A``, leaf ``A-L07``.
    """
    if nodes < 1 or zones < 1 or nodes_per_leaf < 1 or gpus_per_node < 1:
        raise TopologyError("nodes, zones, nodes-per-leaf and gpus per node must all be >= 1")
    if zones > nodes:
        raise TopologyError(f"cannot split {nodes} node(s) into {zones} zones")
    base, extra = divmod(nodes, zones)
    out: list[TopologyNode] = []
    for z in range(zones):
        zone = _zone_name(z)
        count = base + (1 if z < extra else 0)
        leaves = (count + nodes_per_leaf - 1) // nodes_per_leaf
        width = max(2, len(str(leaves - 1)))
        nwidth = max(2, len(str(nodes_per_leaf - 1)))
        for i in range(count):
            leaf_i, slot = divmod(i, nodes_per_leaf)
            leaf = f"{zone}-L{leaf_i:0{width}d}"
            out.append(TopologyNode(f"ff-{zone}-{leaf_i:0{width}d}-{slot:0{nwidth}d}", gpus_per_node, leaf, zone))
    return out


def from_crux(rows: Iterable[Mapping[str, str]], gpus_per_node: int = 8) -> list[TopologyNode]:
    """Convert Crux/Lingjun rows (``ip,DSW,PSW,ASW``) to nodes: zone = DSW, leaf = ASW.

    Host ids are long hashes; a node is named by the shortest prefix (>= 12 characters) that
    keeps every name unique. Rows come out sorted by (zone, leaf, name) for stable output.
    """
    hosts: list[tuple[str, str, str]] = []
    for i, row in enumerate(rows):
        try:
            ip, dsw, asw = row["ip"].strip(), row["DSW"].strip(), row["ASW"].strip()
        except KeyError as exc:
            raise TopologyError(f"crux topology row {i + 1} lacks column {exc.args[0]!r} (need ip,DSW,ASW)") from None
        if not ip or not dsw or not asw:
            raise TopologyError(f"crux topology row {i + 1} has an empty ip, DSW or ASW")
        hosts.append((ip, dsw, asw))
    if not hosts:
        raise TopologyError("crux topology has no hosts")
    ips = [h[0] for h in hosts]
    if len(set(ips)) != len(ips):
        raise TopologyError("crux topology lists a host twice")
    width = 12
    while len({ip[:width] for ip in ips}) != len(ips):
        width += 4
    nodes = [TopologyNode(ip[:width], gpus_per_node, asw, dsw) for ip, dsw, asw in hosts]
    nodes.sort(key=lambda n: (n.zone, n.leaf, n.name))
    return nodes


def parse_topology_csv(text: str) -> list[TopologyNode]:
    """Parse ``node,gpus,leaf,zone`` CSV text (extra columns ignored). Raises TopologyError."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in TOPOLOGY_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise TopologyError(f"topology CSV lacks column(s) {', '.join(missing)}; the header must include node,gpus,leaf,zone")
    out: list[TopologyNode] = []
    seen: set[str] = set()
    for line, row in enumerate(reader, start=2):
        name = (row["node"] or "").strip()
        if not name:
            raise TopologyError(f"line {line}: empty node name")
        if name in seen:
            raise TopologyError(f"line {line}: node {name!r} listed twice")
        seen.add(name)
        try:
            gpus = int(row["gpus"])
        except (TypeError, ValueError):
            raise TopologyError(f"line {line}: gpus must be an integer, got {row['gpus']!r}") from None
        if gpus < 1:
            raise TopologyError(f"line {line}: node {name!r} has {gpus} GPUs")
        leaf, zone = (row["leaf"] or "").strip(), (row["zone"] or "").strip()
        if not leaf or not zone:
            raise TopologyError(f"line {line}: node {name!r} needs a leaf and a zone")
        out.append(TopologyNode(name, gpus, leaf, zone))
    if not out:
        raise TopologyError("topology CSV has no nodes")
    return out


def format_topology_csv(nodes: Iterable[TopologyNode]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(TOPOLOGY_COLUMNS)
    for n in nodes:
        writer.writerow((n.name, n.gpus, n.leaf, n.zone))
    return buf.getvalue()


def summarize(nodes: Iterable[TopologyNode]) -> dict[str, dict[str, int]]:
    """zone -> {"nodes", "gpus", "leaves"}; zones in sorted order."""
    acc: dict[str, dict[str, int]] = {}
    leaves: dict[str, dict[str, None]] = {}
    for n in nodes:
        z = acc.setdefault(n.zone, {"nodes": 0, "gpus": 0, "leaves": 0})
        z["nodes"] += 1
        z["gpus"] += n.gpus
        leaves.setdefault(n.zone, {})[n.leaf] = None
    for zone, ls in leaves.items():
        acc[zone]["leaves"] = len(ls)
    return {z: acc[z] for z in sorted(acc)}
