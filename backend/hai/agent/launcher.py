"""Launch templates: which processes an attempt runs on this node, with which environment, and
how they are started and stopped.

- ``command``: one process per node (RANK = NODE_RANK, LOCAL_RANK 0, WORLD_SIZE = NNODES) that
  sees all the GPUs of the attempt on this node.
- ``torch``: one process per GPU with the torch.distributed environment (HaiScale's launch):
  RANK = node_rank * gpus_per_node + local_rank, WORLD_SIZE = nnodes * gpus_per_node.
- ``hfreduce``: as ``torch``, plus each rank bound to the CPUs of its GPU's NUMA node and given the
  InfiniBand NIC of that NUMA node (NCCL_IB_HCA, HAI_NIC) where the node has InfiniBand.

Each rank runs under the rank wrapper (``rankwrap.py``) as the leader of its own session and
process group, never through a shell; the wrapper copies the rank's stdout/stderr into files in
the attempt's folder.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hai.agent import topology as gpu_topology
from hai.agent.procs import signal_group, start_ticks
from hai.agent.users import Account
from hai.protocol import GpuInfo, LaunchSpec, NicInfo

RANKWRAP = str(Path(__file__).with_name("rankwrap.py"))

# Variables of the agent's own environment that never reach a job: the platform's settings and
# secrets (HAI_*) and a distributed setup the agent itself may have been started with.
_STRIPPED_PREFIXES = ("HAI_",)
_STRIPPED = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "NCCL_IB_HCA", "TORCHELASTIC_RUN_ID",
}


class LaunchError(Exception):
    """The attempt cannot be launched on this node (reported as AttemptStatus.launch_error)."""


@dataclass
class RankPlan:
    rank: int  # global rank
    local_rank: int
    gpus: list[int]
    env: dict[str, str]
    argv: list[str]
    cpus: list[int] | None = None
    numa_node: int | None = None
    nic: str | None = None


@dataclass
class RankProc:
    pid: int
    start_ticks: int | None
    popen: subprocess.Popen | None = field(default=None, repr=False)


def base_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    for k in list(env):
        if k in _STRIPPED or k.startswith(_STRIPPED_PREFIXES):
            del env[k]
    return env


def _nic_for(numa: int | None, nics: list[NicInfo]) -> str | None:
    return gpu_topology.nic_for(numa, [(n.name, n.numa_node) for n in nics])


def plan_ranks(
    spec: LaunchSpec,
    *,
    job_id: int,
    attempt: int,
    node: str,
    node_gpus: list[GpuInfo],
    nics: list[NicInfo],
    control_dir: str,
    checkpoint_dir: str,
    base_env: dict[str, str] | None = None,
    sysfs: str = "/sys",
) -> list[RankPlan]:
    """The ranks this node runs for the attempt. Pure apart from reading sysfs topology."""
    if not spec.command:
        raise LaunchError("empty command")
    by_index = {g.index: g for g in node_gpus}
    unknown = [g for g in spec.gpus if g not in by_index]
    if unknown:
        raise LaunchError(f"GPU indices {unknown} do not exist on node {node} "
                          f"(it has {sorted(by_index)})")
    if len(set(spec.gpus)) != len(spec.gpus):
        raise LaunchError(f"duplicate GPU indices {spec.gpus}")
    if not 0 <= spec.node_rank < max(spec.nnodes, 1):
        raise LaunchError(f"node_rank {spec.node_rank} out of range for nnodes {spec.nnodes}")

    env0 = base_environment() if base_env is None else dict(base_env)
    env0.setdefault("PYTHONUNBUFFERED", "1")  # rank output goes to files: do not block-buffer it
    env0.update(spec.env)
    common = {
        "HAI_JOB_ID": str(job_id),
        "HAI_ATTEMPT": str(attempt),
        "HAI_JOB_NAME": spec.job_name,
        "HAI_USER": spec.user,
        "HAI_NODE": node,
        "HAI_JOB_TYPE": spec.job_type,
        "HAI_RESTART_COUNT": str(spec.restart_count),
        "HAI_CHECKPOINT_DIR": checkpoint_dir,
        "HAI_CONTROL_DIR": control_dir,
        "HAI_SUSPEND_GRACE_S": str(spec.suspend_grace_s),
        "NODE_RANK": str(spec.node_rank),
        "NNODES": str(spec.nnodes),
        "GROUP_RANK": str(spec.node_rank),
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port),
        # CUDA numbers devices fastest-first by default; NVML (and we) by PCI bus id
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    if spec.resume_from:
        common["HAI_RESUME_FROM"] = spec.resume_from

    plans: list[RankPlan] = []
    if spec.job_type == "command":
        env = {**env0, **common}
        env.update({
            "RANK": str(spec.node_rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(spec.nnodes),
            "LOCAL_WORLD_SIZE": "1",
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in spec.gpus),
        })
        plans.append(RankPlan(rank=spec.node_rank, local_rank=0, gpus=list(spec.gpus), env=env,
                              argv=list(spec.command)))
        return plans

    if not spec.gpus:
        raise LaunchError(f"a {spec.job_type} job needs at least one GPU on each node")
    if len(spec.gpus) != spec.gpus_per_node:
        raise LaunchError(f"{len(spec.gpus)} GPUs given for gpus_per_node={spec.gpus_per_node}")
    world = spec.nnodes * spec.gpus_per_node
    for local_rank, g in enumerate(spec.gpus):
        rank = spec.node_rank * spec.gpus_per_node + local_rank
        env = {**env0, **common}
        env.update({
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(len(spec.gpus)),
            "CUDA_VISIBLE_DEVICES": str(g),
        })
        plan = RankPlan(rank=rank, local_rank=local_rank, gpus=[g], env=env, argv=list(spec.command))
        if spec.job_type == "hfreduce":
            numa = by_index[g].numa_node
            plan.numa_node = numa
            if numa is not None:
                plan.cpus = gpu_topology.numa_cpus(numa, sysfs)
                env["HAI_NUMA_NODE"] = str(numa)
            nic = _nic_for(numa, nics)
            if nic:
                plan.nic = nic
                env["HAI_NIC"] = nic
                if "NCCL_IB_HCA" not in spec.env:
                    env["NCCL_IB_HCA"] = nic
        plans.append(plan)
    return plans


def check_executable(argv0: str, env: dict[str, str], cwd: str | None) -> None:
    """Fail early (launch_error) when the program does not exist; the wrapper also reports 127."""
    if os.sep in argv0:
        path = argv0 if os.path.isabs(argv0) else os.path.join(cwd or os.getcwd(), argv0)
        if not os.path.exists(path):
            raise LaunchError(f"command not found: {argv0}")
        if not os.access(path, os.X_OK):
            raise LaunchError(f"command not executable: {argv0}")
        return
    if shutil.which(argv0, path=env.get("PATH", os.defpath)) is None:
        raise LaunchError(f"command not found: {argv0} (PATH={env.get('PATH', '')})")


def spawn_rank(plan: RankPlan, *, cwd: str | None, stdout_path: str, stderr_path: str,
               exit_path: str, pid_path: str, account: Account | None = None,
               lease_path: str | None = None) -> RankProc:
    """Start the rank under the wrapper as a new session (its own process group). With an
    ``account`` the wrapper (the agent's user) runs the command under that Unix account.
    ``lease_path``: the agent's lease (rankwrap.py: the rank stops itself once it has run out)."""
    argv = [sys.executable, "-I", "-S", RANKWRAP, "--exit-file", exit_path, "--pid-file", pid_path]
    if account is not None:
        argv += ["--uid", str(account.uid), "--gid", str(account.gid),
                 "--groups", ",".join(str(g) for g in account.groups)]
    if lease_path:
        argv += ["--lease", lease_path]
    if plan.cpus:
        argv += ["--cpus", ",".join(str(c) for c in plan.cpus)]
    argv += ["--", *plan.argv]
    with open(stdout_path, "ab", buffering=0) as out, open(stderr_path, "ab", buffering=0) as err:
        p = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=plan.env, cwd=cwd,
            start_new_session=True, close_fds=True,
        )
    return RankProc(pid=p.pid, start_ticks=start_ticks(p.pid), popen=p)


def terminate(pgid: int) -> bool:
    return signal_group(pgid, signal.SIGTERM)


def kill(pgid: int) -> bool:
    return signal_group(pgid, signal.SIGKILL)
