"""GPU inventory and metrics: fake GPUs follow the jobs; NVML absent gives a clear error."""

from __future__ import annotations

import sys

import pytest

from hai.agent.gpu import FakeGpus, NvmlUnavailable, make_gpu_backend, parse_cpulist, pci_numa_node
from hai.agent.node import NodeAgent
from hai.agent.testing import assignment, wait_for

PY = sys.executable


def test_fake_gpus_have_a_stable_inventory():
    a = FakeGpus(8, node="n1").inventory()
    b = FakeGpus(8, node="n1").inventory()
    assert a == b and [g.index for g in a] == list(range(8))
    assert len({g.uuid for g in a}) == 8 and all(g.uuid.startswith("GPU-") for g in a)
    assert {g.uuid for g in FakeGpus(8, node="n2").inventory()}.isdisjoint({g.uuid for g in a})


def test_fake_utilisation_follows_the_ranks_running_on_each_gpu(tmp_path):
    node = NodeAgent(node="n1", state_dir=tmp_path / "s", gpus=FakeGpus(4, node="n1"), kill_grace_s=1)
    idle = node.gpu_metrics()
    assert [m.util_pct for m in idle] == [0.0] * 4 and all(m.memory_used_mib == 0 for m in idle)
    node.apply([assignment(1, [PY, "-c", "import time; time.sleep(600)"], job_type="torch", gpus=[1, 3])])
    wait_for(lambda: node.busy_gpus() == {1: 1, 3: 1}, step=node.tick, what="ranks")
    for _ in range(20):  # noise, but always clearly busy
        m = node.gpu_metrics()
        assert m[0].util_pct == 0.0 and m[2].util_pct == 0.0
        assert m[1].util_pct > 70 and m[3].util_pct > 70 and m[1].memory_used_mib > 0
    node.apply([])
    wait_for(lambda: not node.running(), step=node.tick, what="stop")
    assert [m.util_pct for m in node.gpu_metrics()] == [0.0] * 4


def test_without_nvidia_gpus_nvml_fails_with_a_clear_message():
    try:
        backend = make_gpu_backend(fake_gpus=None, node="n1")
    except NvmlUnavailable as e:
        assert "fake-gpus" in str(e) or "NVML" in str(e)
    else:  # a machine with GPUs: real inventory and metrics
        inv = backend.inventory()
        assert inv and all(g.uuid for g in inv)
        m = backend.metrics({})
        assert len(m) == len(inv) and all(0 <= x.util_pct <= 100 for x in m)
        backend.close()


@pytest.mark.parametrize("text, cpus", [("0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11]), ("5", [5]), ("", [])])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


def test_pci_numa_node_reads_sysfs_in_nvml_bus_id_form(tmp_path):
    d = tmp_path / "bus" / "pci" / "devices" / "0000:3b:00.0"
    d.mkdir(parents=True)
    (d / "numa_node").write_text("1\n")
    assert pci_numa_node("00000000:3B:00.0", str(tmp_path)) == 1
    (d / "numa_node").write_text("-1\n")
    assert pci_numa_node("00000000:3B:00.0", str(tmp_path)) is None
    assert pci_numa_node("00000000:AA:00.0", str(tmp_path)) is None
