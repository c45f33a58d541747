"""End to end in Kubernetes mode (issue 14): `hai dev` with HAI_EXECUTOR=kubernetes against the
kmock-based API emulator; fake kubelets run every pod's containers as real local processes.
The scheduler, the job-outcome rules and the SDK are the platform's own."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.e2e.conftest import REPO
from tests.kube.stack import NAMESPACE, gpu_node, start_kube_stack, stop_kube_stack, wait_for

pytest.importorskip("torch", reason="torch is installed by `make test` (torch==2.13.0)")

EXAMPLE = str(REPO / "examples" / "haiscale_ddp.py")
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture
def kube(tmp_path):
    ks = start_kube_stack(tmp_path, nodes=[gpu_node("gpu-a", gpus=2, leaf="A1"), gpu_node("gpu-b", gpus=2, leaf="A1")])
    yield ks
    stop_kube_stack(ks)


def _final(logs: str) -> tuple[int, str]:
    m = re.search(r"\[(?:attempt \d+ )?rank 0\] final step=(\d+) checksum=(\w+)", logs)
    assert m, logs[-2000:]
    return int(m.group(1)), m.group(2)


def _no_objects_left(kube, job_id: int) -> bool:
    return all(kube.objects(kind, job_id) == [] for kind in ("pods", "services", "configmaps"))


def test_two_node_torch_job_runs_as_pinned_pods_and_succeeds(kube):
    stack = kube.stack
    cmd = [sys.executable, EXAMPLE, "--steps", "40", "--step-sleep", "0.02", "--backend", "gloo", "--log-every", "20"]
    job = stack.submit(name="ddp", nodes=2, gpus_per_node=2, job_type="torch", command=cmd)
    pods = wait_for(lambda: len(p := kube.job_pods(job["id"])) == 2 and p, timeout=60, what="one pod per node")
    by_node = {p["spec"]["nodeName"]: p for p in pods}
    assert set(by_node) == {"gpu-a", "gpu-b"}
    for p in pods:
        spec, meta = p["spec"], p["metadata"]
        assert spec["restartPolicy"] == "Never"
        assert [c["resources"]["limits"]["nvidia.com/gpu"] for c in spec["containers"]] == ["1", "1"]
        owner = meta["ownerReferences"][0]
        assert owner["kind"] == "ConfigMap" and owner["name"] == f"hai-j{job['id']}-a1"
        env = {e["name"]: e["value"] for e in spec["containers"][1]["env"]}
        rank = int(meta["labels"]["hai.io/node-rank"]) * 2 + 1
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
        assert env["MASTER_ADDR"] == f"hai-j{job['id']}-a1.{NAMESPACE}.svc"
        assert env["HAI_JOB_ID"] == str(job["id"]) and env["HAI_ATTEMPT"] == "1"
    svc = kube.objects("services", job["id"])
    assert len(svc) == 1 and svc[0]["spec"]["clusterIP"] == "None"
    assert svc[0]["spec"]["selector"]["hai.io/node-rank"] == "0"

    done = stack.wait_state(job["id"], TERMINAL, timeout=180)
    assert done["state"] == "succeeded", (done, stack.logs(job["id"])[-3000:])
    assert done["exit_code"] == 0
    logs = stack.logs(job["id"])
    assert _final(logs)[0] == 40
    assert "\x1ehai-event" not in logs  # SDK events travel in the log stream but are not stored
    # finished and released: the parent is deleted, its Service and pods go with it
    wait_for(lambda: _no_objects_left(kube, job["id"]), timeout=60, what="the attempt's objects to be deleted")
    assert all(n["state"] == "ready" for n in (kube.node("gpu-a"), kube.node("gpu-b")))
