"""`hai dev` in Kubernetes mode (HAI_EXECUTOR=kubernetes) against the emulator, with fake kubelets
running the pods as local processes. The platform is a real process; the emulator and the
kubelets live in the test process."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from tests.e2e.conftest import Stack, start_stack, stop_stack, wait_for
from tests.kube.emulator import Cluster, api_for
from tests.kube.kubelet import FakeKubelet, gpu_node

NAMESPACE = "hai-jobs"


@dataclass
class KubeStack:
    stack: Stack
    cluster: Cluster
    kubelet: FakeKubelet
    core: client.CoreV1Api
    tmp: Path

    def pods(self, selector: str = "app.kubernetes.io/managed-by=hai") -> list[dict]:
        return json.loads(self.core.list_namespaced_pod(NAMESPACE, label_selector=selector,
                                                        _preload_content=False).data)["items"]

    def job_pods(self, job_id: int) -> list[dict]:
        return self.pods(f"hai.io/job-id={job_id}")

    def objects(self, kind: str, job_id: int) -> list[dict]:
        fn = {"configmaps": self.core.list_namespaced_config_map, "services": self.core.list_namespaced_service,
              "pods": self.core.list_namespaced_pod}[kind]
        return json.loads(fn(NAMESPACE, label_selector=f"hai.io/job-id={job_id}", _preload_content=False).data)["items"]

    def node(self, name: str) -> dict:
        with self.stack.client() as c:
            return next(n for n in c.get("/api/v1/nodes").json() if n["name"] == name)


def start_kube_stack(tmp_path: Path, *, nodes: list[dict], kubelet_nodes: set[str] | None = None,
                     extra_env: dict | None = None, reuse: KubeStack | None = None) -> KubeStack:
    """``reuse``: the cluster and kubelet of an earlier stack (a platform restart)."""
    if reuse is None:
        cluster = Cluster(tmp_path).start()
        api = api_for(cluster)
        core = client.CoreV1Api(api)
        for n in nodes:
            core.create_node(n, _preload_content=False)
        kubelet = FakeKubelet(cluster, api, namespace=NAMESPACE, workdir=tmp_path / "kubelet", nodes=kubelet_nodes).start()
    else:
        cluster, kubelet, core = reuse.cluster, reuse.kubelet, reuse.core
    ckpt = tmp_path / "checkpoints"
    want = {n["metadata"]["name"] for n in nodes}
    stack = start_stack(tmp_path, agents=0, extra_env={
        "HAI_EXECUTOR": "kubernetes", "HAI_KUBERNETES__KUBECONFIG": str(cluster.kubeconfig),
        "HAI_KUBERNETES__NAMESPACE": NAMESPACE, "HAI_KUBERNETES__PYTHON": sys.executable,
        # a shared filesystem for checkpoints, mounted at the same path in every pod
        "HAI_KUBERNETES__CHECKPOINT_HOST_PATH": str(ckpt), "HAI_KUBERNETES__CHECKPOINT_MOUNT": str(ckpt),
        "HAI_KUBERNETES__RECONCILE_INTERVAL_S": "0.2", "HAI_SCHEDULER__MIN_RUNTIME_S": "0",
        **(extra_env or {}),
    }, nodes_ready=lambda got: {n["name"] for n in got} >= want, what="hai dev (kubernetes mode) and its nodes")
    return KubeStack(stack=stack, cluster=cluster, kubelet=kubelet, core=core, tmp=tmp_path)


def stop_kube_stack(ks: KubeStack) -> None:
    try:
        stop_stack(ks.stack)
    finally:
        ks.kubelet.close()
        ks.cluster.stop()


__all__ = ["KubeStack", "start_kube_stack", "stop_kube_stack", "gpu_node", "NAMESPACE", "wait_for"]
