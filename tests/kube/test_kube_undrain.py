"""Undrain in Kubernetes mode (issue 14). The backend's virtual agents run no validators (on those
nodes the kubelet and the device plugin watch the hardware), so an undrain without force does
not wait for a validation run that would never come: it checks the Kubernetes Node. Ready: the
node is back in service at once and uncordoned; NotReady: 409 and nothing changes."""

from __future__ import annotations

import json

import pytest

from tests.kube.stack import gpu_node, start_kube_stack, stop_kube_stack, wait_for


@pytest.fixture
def kube(tmp_path):
    # an undrain that waited for a validation run would fail only after this long: far beyond the asserts
    ks = start_kube_stack(tmp_path, nodes=[gpu_node("gpu-a", gpus=2), gpu_node("gpu-b", gpus=2)],
                          extra_env={"HAI_VALIDATION__UNDRAIN_TIMEOUT_S": "600"})
    yield ks
    stop_kube_stack(ks)


def _k8s_node(kube, name: str) -> dict:
    return json.loads(kube.core.read_node(name, _preload_content=False).data)


def _set_ready(kube, name: str, ready: bool) -> None:
    kube.core.patch_node(name, {"status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady" if ready else "KubeletNotReady"}]}})


def test_undrain_without_force_checks_the_kubernetes_node_instead_of_a_validation_run(kube):
    with kube.stack.client() as c:
        r = c.post("/api/v1/nodes/gpu-b/drain", json={"reason": "GPU 1 ECC errors"})
        assert r.status_code == 200, r.text
        assert kube.node("gpu-b")["state"] == "drained"
        wait_for(lambda: _k8s_node(kube, "gpu-b")["spec"].get("unschedulable") is True, what="the cordon")

        # the Kubernetes Node is NotReady: refused, the node stays drained and cordoned
        _set_ready(kube, "gpu-b", False)
        r = c.post("/api/v1/nodes/gpu-b/undrain", json={}, timeout=120)
        assert r.status_code == 409, r.text
        assert "not Ready" in r.json()["detail"] and "force" in r.json()["detail"]
        assert kube.node("gpu-b")["state"] == "drained"
        assert _k8s_node(kube, "gpu-b")["spec"].get("unschedulable") is True

        # Ready again: back at once (no validation run requested, none waited for), uncordoned
        _set_ready(kube, "gpu-b", True)
        r = c.post("/api/v1/nodes/gpu-b/undrain", json={}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "ready"
        assert "Kubernetes" in r.json()["state_reason"]
        assert _k8s_node(kube, "gpu-b")["spec"].get("unschedulable") is False
        assert c.get("/api/v1/nodes/gpu-b/validations").json() == []
        # and it takes work again: a job of both nodes is placed
        job = kube.stack.submit(name="after-undrain", nodes=2, gpus_per_node=2, command=["bash", "-c", "echo ok"])
        pods = wait_for(lambda: len(p := kube.job_pods(job["id"])) == 2 and p, timeout=60, what="the job's pods")
        assert sorted(p["spec"]["nodeName"] for p in pods) == ["gpu-a", "gpu-b"]
