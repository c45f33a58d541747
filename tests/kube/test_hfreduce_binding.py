"""hfreduce in pods gets the NUMA/NIC binding that the agent's launcher gives it: each rank's
container runs the pod wrapper with ``--bind numa``, which finds the container's GPU, binds the
command to the CPUs of that GPU's NUMA node and hands it that node's InfiniBand HCA; with an RDMA
device plugin configured, each container asks for one of its resource."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hai.agent import launcher
from hai.agent.gpu import discover_nics
from hai.integrations.kubernetes import objects as ob
from hai.protocol import Assignment, GpuInfo, LaunchSpec

NS = "hai-jobs"
PARENT = {"metadata": {"name": "hai-j7-a3", "uid": "u-1"}}


def _assignment(job_type: str, gpus: int = 2, env: dict | None = None) -> Assignment:
    return Assignment(job_id=7, attempt=3, action="run", spec=LaunchSpec(
        job_name="t", user="alice", command=["python", "train.py"], env=env or {}, job_type=job_type,
        gpus=list(range(gpus)), node_rank=0, nnodes=1, gpus_per_node=gpus, master_addr="x", master_port=29555))


def test_hfreduce_pods_run_their_ranks_under_the_numa_binding():
    pod = ob.attempt_pod(_assignment("hfreduce"), node="gpu-1", namespace=NS, parent=PARENT, image="img",
                         python="python3", gpu_resource="nvidia.com/gpu", rdma_resource="rdma/hca_shared_devices_a")
    for c in pod["spec"]["containers"]:
        assert c["command"][:7] == ["python3", "-m", "hai.integrations.kubernetes.podwrap", "--bind", "numa", "--",
                                    "python"]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "1", "rdma/hca_shared_devices_a": "1"}
        assert c["resources"]["requests"] == c["resources"]["limits"]
    # torch ranks are not bound, and no RDMA resource is asked for when none is configured
    torch = ob.attempt_pod(_assignment("torch"), node="gpu-1", namespace=NS, parent=PARENT, image="img",
                           python="python3", gpu_resource="nvidia.com/gpu", rdma_resource="rdma/hca_shared_devices_a")
    assert all("--bind" not in c["command"] for c in torch["spec"]["containers"])
    plain = ob.attempt_pod(_assignment("hfreduce"), node="gpu-1", namespace=NS, parent=PARENT, image="img",
                           python="python3", gpu_resource="nvidia.com/gpu")
    assert [c["resources"]["limits"] for c in plain["spec"]["containers"]] == [{"nvidia.com/gpu": "1"}] * 2


def _host(tmp: Path) -> tuple[Path, Path, list[int]]:
    """A two-socket host: GPU-a (minor 0) and mlx5_0 on NUMA node 0, GPU-b (minor 1) and mlx5_1 on
    node 1, each node with one of the CPUs this test may use."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = [allowed[0], allowed[-1]]
    sysfs, procfs = tmp / "sys", tmp / "proc"
    for numa, (bus, uuid, nic) in enumerate([("0000:3b:00.0", "GPU-a", "mlx5_0"), ("0000:af:00.0", "GPU-b", "mlx5_1")]):
        info = procfs / "driver" / "nvidia" / "gpus" / bus
        info.mkdir(parents=True)
        (info / "information").write_text(f"Model: \t\t NVIDIA A100\nGPU UUID: \t {uuid}\nDevice Minor: \t {numa}\n")
        dev = sysfs / "bus" / "pci" / "devices" / bus
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{numa}\n")
        node = sysfs / "devices" / "system" / "node" / f"node{numa}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(f"{cpus[numa]}\n")
        hca = sysfs / "class" / "infiniband" / nic / "device"
        hca.mkdir(parents=True)
        (hca / "numa_node").write_text(f"{numa}\n")
    return sysfs, procfs, cpus


def _run_rank(tmp: Path, sysfs: Path, procfs: Path, **env: str) -> dict:
    probe = ("import json, os; print(json.dumps({'cpus': sorted(os.sched_getaffinity(0)), 'env': "
             "{k: os.environ.get(k) for k in ('HAI_NUMA_NODE', 'HAI_NIC', 'NCCL_IB_HCA')}}))")
    proc = subprocess.run(
        [sys.executable, "-m", "hai.integrations.kubernetes.podwrap", "--bind", "numa", "--sysfs", str(sysfs),
         "--procfs", str(procfs), "--", sys.executable, "-c", probe],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_podwrap_binds_the_rank_as_the_agent_launcher_does(tmp_path):
    sysfs, procfs, cpus = _host(tmp_path)
    # the device plugin gave this container GPU-b (by UUID, its default) -> NUMA node 1
    got = _run_rank(tmp_path, sysfs, procfs, NVIDIA_VISIBLE_DEVICES="GPU-b")
    assert got == {"cpus": [cpus[1]], "env": {"HAI_NUMA_NODE": "1", "HAI_NIC": "mlx5_1", "NCCL_IB_HCA": "mlx5_1"}}
    # the agent's launcher binds a rank on the same GPU of the same host identically
    gpus = [GpuInfo(index=i, uuid=u, model="A100", memory_total_mib=1, numa_node=i) for i, u in enumerate(["GPU-a", "GPU-b"])]
    spec = _assignment("hfreduce").spec
    plans = launcher.plan_ranks(spec, job_id=7, attempt=3, node="n", node_gpus=gpus, nics=discover_nics(str(sysfs)),
                                control_dir="/c", checkpoint_dir="/k", base_env={}, sysfs=str(sysfs))
    agent = plans[1]
    assert agent.cpus == got["cpus"]
    assert {k: agent.env.get(k) for k in ("HAI_NUMA_NODE", "HAI_NIC", "NCCL_IB_HCA")} == got["env"]
    # by index (device plugins that pass indices), and a job that chose its own HCA keeps it
    got = _run_rank(tmp_path, sysfs, procfs, NVIDIA_VISIBLE_DEVICES="0", NCCL_IB_HCA="mlx5_9")
    assert got == {"cpus": [cpus[0]], "env": {"HAI_NUMA_NODE": "0", "HAI_NIC": "mlx5_0", "NCCL_IB_HCA": "mlx5_9"}}


def test_podwrap_without_a_known_gpu_leaves_the_rank_unbound(tmp_path):
    sysfs, procfs, _ = _host(tmp_path)
    got = _run_rank(tmp_path, sysfs, procfs, NVIDIA_VISIBLE_DEVICES="GPU-unknown")
    # no NUMA node: every CPU it had, and all the HCAs for NCCL to choose from (the launcher's rule)
    assert got == {"cpus": sorted(os.sched_getaffinity(0)),
                   "env": {"HAI_NUMA_NODE": None, "HAI_NIC": "mlx5_0,mlx5_1", "NCCL_IB_HCA": "mlx5_0,mlx5_1"}}
