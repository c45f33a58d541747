"""Translations between Kubernetes objects (plain JSON dicts, as the API serves them) and the
agent protocol. Pure functions: no client, no database.

Per attempt: one parent ConfigMap ``hai-j<job>-a<attempt>``; owned by it (deleting it removes
everything) a headless Service of the same name selecting the attempt's node-rank-0 pod
(MASTER_ADDR), and one pod per node ``hai-j<job>-a<attempt>-n<node_rank>``, pinned with
``nodeName``, ``restartPolicy: Never``, one container per rank (``command`` jobs: one container
with all the node's GPUs of the attempt; ``torch``/``hfreduce``: one per GPU), each asking
``nvidia.com/gpu`` for its GPUs, so a rank's container exit code is the rank's exit code.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime

from hai.protocol import AgentHello, Assignment, AttemptStatus, GpuInfo, RankStatus

MANAGED_BY = "app.kubernetes.io/managed-by"
JOB_LABEL = "hai.io/job-id"
ATTEMPT_LABEL = "hai.io/attempt"
NODE_RANK_LABEL = "hai.io/node-rank"
SUSPEND_ANNOTATION = "hai.io/suspend"
STOP_ANNOTATION = "hai.io/stop"  # JSON {cause, reason, at}: why the backend deleted this pod
CREATED_ANNOTATION = "hai.io/created-at"
CORDON_ANNOTATION = "hai.io/cordon-reason"

CONTROL_MOUNT = "/hai/control"
PODINFO_MOUNT = "/hai/podinfo"

# container waiting reasons that mean the rank can never start: the attempt cannot be launched
LAUNCH_FAILURES = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
    "CreateContainerError", "RunContainerError", "ErrImageNeverPull",
})

_EXCLUDED_ENV = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
}


def attempt_name(job_id: int, attempt: int) -> str:
    return f"hai-j{job_id}-a{attempt}"


def pod_name(job_id: int, attempt: int, node_rank: int) -> str:
    return f"{attempt_name(job_id, attempt)}-n{node_rank}"


def attempt_labels(job_id: int, attempt: int) -> dict[str, str]:
    return {MANAGED_BY: "hai", JOB_LABEL: str(job_id), ATTEMPT_LABEL: str(attempt)}


def key_of(obj: dict) -> tuple[int, int] | None:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    try:
        return int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL])
    except (KeyError, ValueError):
        return None


# -- nodes -----------------------------------------------------------------------------------
def parse_quantity(q) -> int:
    """Whole units of a resource quantity ("8", 8, "8k" is not a GPU count)."""
    if q is None:
        return 0
    try:
        return int(str(q))
    except ValueError:
        m = re.fullmatch(r"(\d+)", str(q).strip())
        return int(m.group(1)) if m else 0


def node_address(node: dict) -> str:
    addrs = (node.get("status") or {}).get("addresses") or []
    for kind in ("InternalIP", "ExternalIP", "Hostname"):
        for a in addrs:
            if a.get("type") == kind and a.get("address"):
                return a["address"]
    return node["metadata"]["name"]


def node_hello(node: dict, *, zone_label: str, leaf_label: str, gpu_resource: str) -> AgentHello:
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = node.get("status") or {}
    count = parse_quantity((status.get("allocatable") or {}).get(gpu_resource))
    model = labels.get("nvidia.com/gpu.product", gpu_resource)
    mem = parse_quantity(labels.get("nvidia.com/gpu.memory"))
    name = meta["name"]
    return AgentHello(
        node=name, zone=labels.get(zone_label), leaf=labels.get(leaf_label), address=node_address(node),
        gpus=[GpuInfo(index=i, uuid=f"k8s-{name}-{i}", model=model, memory_total_mib=mem) for i in range(count)],
        agent_version="kubernetes",
    )


def node_condition(node: dict) -> tuple[str, str]:
    """(platform node state, reason) for a Kubernetes Node: cordoned -> drained, NotReady ->
    unhealthy, else ready."""
    spec = node.get("spec") or {}
    meta = node.get("metadata") or {}
    if spec.get("unschedulable"):
        why = (meta.get("annotations") or {}).get(CORDON_ANNOTATION) or "cordoned in Kubernetes"
        return "drained", why
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            if c.get("status") != "True":
                return "unhealthy", f"Kubernetes node not Ready ({c.get('reason') or c.get('status')})"
            return "ready", ""
    return "unhealthy", "Kubernetes node has no Ready condition"


# -- per attempt objects ---------------------------------------------------------------------
def parent_configmap(a: Assignment, *, namespace: str, now: float) -> dict:
    name = attempt_name(a.job_id, a.attempt)
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": attempt_labels(a.job_id, a.attempt),
                     "annotations": {CREATED_ANNOTATION: repr(now), "hai.io/job-name": a.spec.job_name,
                                     "hai.io/user": a.spec.user, "hai.io/nnodes": str(a.spec.nnodes)}},
        "data": {"job_id": str(a.job_id), "attempt": str(a.attempt), "nnodes": str(a.spec.nnodes)},
    }


def owner_ref(parent: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "name": parent["metadata"]["name"],
            "uid": parent["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def master_service(a: Assignment, *, namespace: str, parent: dict) -> dict:
    name = attempt_name(a.job_id, a.attempt)
    selector = {**attempt_labels(a.job_id, a.attempt), NODE_RANK_LABEL: "0"}
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": attempt_labels(a.job_id, a.attempt),
                     "ownerReferences": [owner_ref(parent)]},
        "spec": {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses": True,
                 "ports": [{"name": "master", "port": a.spec.master_port, "targetPort": a.spec.master_port}]},
    }


def master_host(job_id: int, attempt: int, namespace: str) -> str:
    return f"{attempt_name(job_id, attempt)}.{namespace}.svc"


def _env_list(env: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in sorted(env.items())]


def rank_envs(a: Assignment, *, node: str, namespace: str, checkpoint_dir: str) -> list[tuple[int, int, int, dict[str, str]]]:
    """(rank, local_rank, gpus, env) per container: the job type's environment, as the agent's
    launch templates give it (minus CUDA_VISIBLE_DEVICES: the device plugin sets it)."""
    spec = a.spec
    env0 = {k: v for k, v in spec.env.items() if k not in _EXCLUDED_ENV}
    env0.setdefault("PYTHONUNBUFFERED", "1")
    common = {
        "HAI_JOB_ID": str(a.job_id), "HAI_ATTEMPT": str(a.attempt), "HAI_JOB_NAME": spec.job_name,
        "HAI_USER": spec.user, "HAI_NODE": node, "HAI_JOB_TYPE": spec.job_type,
        "HAI_RESTART_COUNT": str(spec.restart_count), "HAI_CHECKPOINT_DIR": checkpoint_dir,
        "HAI_CONTROL_DIR": CONTROL_MOUNT, "HAI_PODINFO_DIR": PODINFO_MOUNT,
        "HAI_SUSPEND_GRACE_S": str(spec.suspend_grace_s), "NODE_RANK": str(spec.node_rank),
        "NNODES": str(spec.nnodes), "GROUP_RANK": str(spec.node_rank),
        # several nodes: the attempt's headless Service selects the node-rank-0 pod; one node:
        # every rank runs in this pod
        "MASTER_ADDR": master_host(a.job_id, a.attempt, namespace) if spec.nnodes > 1 else "127.0.0.1",
        "MASTER_PORT": str(spec.master_port),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    if spec.resume_from:
        common["HAI_RESUME_FROM"] = spec.resume_from
    if spec.job_type == "command":
        env = {**env0, **common, "RANK": str(spec.node_rank), "LOCAL_RANK": "0",
               "WORLD_SIZE": str(spec.nnodes), "LOCAL_WORLD_SIZE": "1"}
        return [(spec.node_rank, 0, len(spec.gpus), env)]
    world = spec.nnodes * spec.gpus_per_node
    out = []
    for local in range(spec.gpus_per_node):
        rank = spec.node_rank * spec.gpus_per_node + local
        env = {**env0, **common, "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(spec.gpus_per_node)}
        out.append((rank, local, 1, env))
    return out


def attempt_pod(a: Assignment, *, node: str, namespace: str, parent: dict, image: str, python: str,
                gpu_resource: str, image_pull_policy: str = "IfNotPresent", service_account: str = "",
                checkpoint_claim: str = "", checkpoint_host_path: str = "",
                checkpoint_mount: str = "/hai/checkpoints", stop_grace_s: float = 10.0,
                rdma_resource: str = "") -> dict:
    """The attempt's pod on ``node``. hfreduce ranks are bound as the agent binds them: the
    wrapper runs with ``--bind numa`` (CPUs of the GPU's NUMA node, that node's HCA in HAI_NIC /
    NCCL_IB_HCA) and each container asks for one ``rdma_resource`` (an RDMA device plugin's
    resource, e.g. ``rdma/hca_shared_devices_a``) when one is configured."""
    spec = a.spec
    ckpt = f"{checkpoint_mount.rstrip('/')}/{a.job_id}/checkpoints"
    volumes: list[dict] = [
        {"name": "hai-control", "emptyDir": {}},
        {"name": "hai-podinfo", "downwardAPI": {"items": [
            {"path": "suspend", "fieldRef": {"fieldPath": f"metadata.annotations['{SUSPEND_ANNOTATION}']"}},
        ]}},
    ]
    mounts = [{"name": "hai-control", "mountPath": CONTROL_MOUNT},
              {"name": "hai-podinfo", "mountPath": PODINFO_MOUNT, "readOnly": True}]
    if checkpoint_claim:
        volumes.append({"name": "hai-checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_claim}})
        mounts.append({"name": "hai-checkpoints", "mountPath": checkpoint_mount})
    elif checkpoint_host_path:
        volumes.append({"name": "hai-checkpoints", "hostPath": {"path": checkpoint_host_path, "type": "DirectoryOrCreate"}})
        mounts.append({"name": "hai-checkpoints", "mountPath": checkpoint_mount})
    containers = []
    for rank, local, gpus, env in rank_envs(a, node=node, namespace=namespace, checkpoint_dir=ckpt):
        limits = {gpu_resource: str(gpus)} if gpus else {}
        wrap = [python, "-m", "hai.integrations.kubernetes.podwrap"]
        if spec.job_type == "hfreduce":
            wrap += ["--bind", "numa"]
            if rdma_resource:
                limits[rdma_resource] = "1"
        containers.append({
            "name": f"rank-{rank}",
            "image": image,
            "imagePullPolicy": image_pull_policy,
            "command": [*wrap, "--", *spec.command],
            "env": _env_list(env),
            "resources": {"limits": limits, "requests": dict(limits)},
            "volumeMounts": [dict(m) for m in mounts],
            **({"workingDir": spec.cwd} if spec.cwd else {}),
        })
    labels = {**attempt_labels(a.job_id, a.attempt), NODE_RANK_LABEL: str(spec.node_rank)}
    pod: dict = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": pod_name(a.job_id, a.attempt, spec.node_rank), "namespace": namespace, "labels": labels,
            "annotations": {"hai.io/job-name": spec.job_name, "hai.io/user": spec.user,
                            "hai.io/job-type": spec.job_type},
            "ownerReferences": [owner_ref(parent)],
        },
        "spec": {
            "nodeName": node,  # the platform placed it: bypass the Kubernetes scheduler
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": max(0, int(round(stop_grace_s))),
            "tolerations": [{"key": gpu_resource, "operator": "Exists", "effect": "NoSchedule"}],
            "enableServiceLinks": False,
            "containers": containers,
            "volumes": volumes,
        },
    }
    if service_account:
        pod["spec"]["serviceAccountName"] = service_account
    if spec.max_runtime_s:
        # the kubelet enforces it too, should the backend be down
        pod["spec"]["activeDeadlineSeconds"] = max(1, int(spec.max_runtime_s) + 30)
    return pod


def suspend_value(requested_at: float, grace_s: float) -> str:
    return json.dumps({"requested_at": requested_at, "grace_s": grace_s}, separators=(",", ":"))


# -- pods -> attempt status ------------------------------------------------------------------
def _ts(s: str | None) -> float | None:
    if not s:
        return None
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _rank_of(container_name: str) -> int | None:
    m = re.fullmatch(r"rank-(\d+)", container_name)
    return int(m.group(1)) if m else None


def pod_ranks(pod: dict) -> tuple[list[RankStatus], str | None, float | None, float | None]:
    """(ranks, launch error, started_at, finished_at) of a pod from its status. A rank appears
    once its container has started (running or terminated)."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    by_name = {c.get("name"): c for c in status.get("containerStatuses") or []}
    ranks: list[RankStatus] = []
    error = None
    started: list[float] = []
    finished: list[float] = []
    containers = spec.get("containers") or []
    for local, c in enumerate(containers):
        rank = _rank_of(c["name"])
        if rank is None:
            continue
        cs = by_name.get(c["name"]) or {}
        state = cs.get("state") or {}
        if "terminated" in state:
            t = state["terminated"] or {}
            ranks.append(RankStatus(rank=rank, local_rank=local, state="exited", exit_code=t.get("exitCode")))
            if t.get("startedAt"):
                started.append(_ts(t["startedAt"]) or 0.0)
            if t.get("finishedAt"):
                finished.append(_ts(t["finishedAt"]) or 0.0)
        elif "running" in state:
            ranks.append(RankStatus(rank=rank, local_rank=local, state="running"))
            if (state["running"] or {}).get("startedAt"):
                started.append(_ts(state["running"]["startedAt"]) or 0.0)
        elif "waiting" in state:
            w = state["waiting"] or {}
            if w.get("reason") in LAUNCH_FAILURES:
                error = f"container {c['name']}: {w.get('reason')}: {w.get('message') or ''}".strip()
    phase = status.get("phase")
    if phase == "Failed" and not ranks and error is None:
        error = f"pod failed before its containers ran: {status.get('reason') or ''} {status.get('message') or ''}".strip()
    return ranks, error, (min(started) if started else None), (max(finished) if finished else None)


def pod_all_started(pod: dict) -> bool:
    ranks, _, _, _ = pod_ranks(pod)
    n = len([c for c in (pod.get("spec") or {}).get("containers") or [] if _rank_of(c["name"]) is not None])
    return n > 0 and len(ranks) >= n


def pod_finished(pod: dict) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        return True
    ranks, error, _, _ = pod_ranks(pod)
    n = len((pod.get("spec") or {}).get("containers") or [])
    return (n > 0 and len(ranks) >= n and all(r.state == "exited" for r in ranks)) or error is not None


def now() -> float:
    return time.time()


__all__ = [
    "AttemptStatus", "node_hello", "node_condition", "parent_configmap", "master_service", "attempt_pod",
    "pod_ranks", "pod_finished", "pod_all_started", "key_of", "attempt_name", "pod_name",
]
