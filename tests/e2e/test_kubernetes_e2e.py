"""End to end in Kubernetes mode (issue 14): `hai dev` with HAI_EXECUTOR=kubernetes against the
kmock-based API emulator; fake kubelets run every pod's containers as real local processes.
The scheduler, the job-outcome rules and the SDK are the platform's own."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.conftest import DDP_EXAMPLE, TERMINAL, final_step, low_job_yields_to_high_job_and_resumes_exactly
from tests.kube.stack import NAMESPACE, gpu_node, start_kube_stack, stop_kube_stack, wait_for

pytest.importorskip("torch", reason="torch is installed by `make test` (torch==2.13.0)")



@pytest.fixture
def kube(tmp_path):
    ks = start_kube_stack(tmp_path, nodes=[gpu_node("gpu-a", gpus=2, leaf="A1"), gpu_node("gpu-b", gpus=2, leaf="A1")])
    yield ks
    stop_kube_stack(ks)


def _no_objects_left(kube, job_id: int) -> bool:
    return all(kube.objects(kind, job_id) == [] for kind in ("pods", "services", "configmaps"))


def test_two_node_torch_job_runs_as_pinned_pods_and_succeeds(kube):
    stack = kube.stack
    cmd = [sys.executable, DDP_EXAMPLE, "--steps", "40", "--step-sleep", "0.02", "--backend", "gloo", "--log-every", "20"]
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
    assert final_step(logs)[0] == 40
    assert "\x1ehai-event" not in logs  # SDK events travel in the log stream but are not stored
    # finished and released: the parent is deleted, its Service and pods go with it
    wait_for(lambda: _no_objects_left(kube, job["id"]), timeout=60, what="the attempt's objects to be deleted")
    assert all(n["state"] == "ready" for n in (kube.node("gpu-a"), kube.node("gpu-b")))


def test_low_job_suspended_at_checkpoint_for_high_job_resumes_exactly(kube):
    def annotated(job_id: int) -> bool:
        # the pods are told through their suspend annotation (downwardAPI volume -> SDK control dir)
        pods = kube.job_pods(job_id)
        return bool(pods) and all(p["metadata"].get("annotations", {}).get("hai.io/suspend") for p in pods)

    low_job_yields_to_high_job_and_resumes_exactly(kube.stack, suspend_requested=annotated)


def test_deaf_job_is_stopped_after_its_grace_period(kube):
    stack = kube.stack
    job = stack.submit(name="stubborn", gpus_per_node=1, suspend_grace_s=2,
                       command=["bash", "-c", "trap '' TERM; echo ignoring; sleep 600"])
    stack.wait_state(job["id"], {"running"})
    wait_for(lambda: "ignoring" in stack.logs(job["id"]), what="the job's output")
    wait_for(lambda: kube.kubelet.alive_processes() >= 1, what="the job's process")
    with stack.client() as c:
        assert c.post(f"/api/v1/jobs/{job['id']}/suspend").json()["state"] == "suspending"
    stopped = stack.wait_state(job["id"], {"queued"}, timeout=60)
    assert stopped["suspensions"] == 1 and stopped["held"] is True
    assert stopped["exit_code"] is None and stopped["failure_reason"] is None
    assert stopped["lost_gpu_s"] > 0
    assert "stopped without a checkpoint" in stopped["events"][-1]["reason"]
    assert "suspend_grace_s=2" in stopped["events"][-1]["reason"]
    # SIGTERM ignored: the kubelet killed it after the pod's grace period; nothing left
    wait_for(lambda: kube.kubelet.alive_processes() == 0, what="SIGKILL after SIGTERM was ignored")
    wait_for(lambda: _no_objects_left(kube, job["id"]), timeout=60, what="the pod to be gone")


def test_cancelled_job_leaves_no_pod(kube):
    stack = kube.stack
    job = stack.submit(name="long", nodes=2, gpus_per_node=2, command=["bash", "-c", "echo started; sleep 600"])
    stack.wait_state(job["id"], {"running"})
    wait_for(lambda: len(kube.job_pods(job["id"])) == 2, what="its pods")
    with stack.client() as c:
        assert c.post(f"/api/v1/jobs/{job['id']}/cancel").status_code == 200
    wait_for(lambda: _no_objects_left(kube, job["id"]), timeout=60, what="no pod, Service or parent left")
    wait_for(lambda: kube.kubelet.alive_processes() == 0, what="its processes to end")
    assert stack.job(job["id"])["state"] == "cancelled"
    # the GPUs are free again once the pods are gone
    nxt = stack.submit(name="after", nodes=2, gpus_per_node=2, command=["bash", "-c", "echo next"])
    assert stack.wait_state(nxt["id"], TERMINAL, timeout=90)["state"] == "succeeded"


def test_node_cordoned_in_kubernetes_gets_nothing_new(kube):
    stack = kube.stack
    kube.core.patch_node("gpu-b", {"spec": {"unschedulable": True}})
    wait_for(lambda: kube.node("gpu-b")["state"] == "drained", what="the cordon to reach the platform")
    jobs = [stack.submit(name=f"j{i}", gpus_per_node=2, command=["bash", "-c", "sleep 1; echo ok"]) for i in range(3)]
    for j in jobs:
        assert stack.wait_state(j["id"], TERMINAL, timeout=120)["state"] == "succeeded"
    # every one of them ran on the node that is not cordoned
    with stack.client() as c:
        for j in jobs:
            events = c.get(f"/api/v1/jobs/{j['id']}").json()
            assert [a["node"] for a in events["placement"]] == ["gpu-a"], events["placement"]
    kube.core.patch_node("gpu-b", {"spec": {"unschedulable": False}})
    wait_for(lambda: kube.node("gpu-b")["state"] == "ready", what="the uncordon to reach the platform")


def test_gang_timeout_requeues_the_job_as_not_started(tmp_path):
    # gpu-c has no kubelet: its pod stays Pending, so the attempt never runs as a whole
    ks = start_kube_stack(tmp_path, nodes=[gpu_node("gpu-a", gpus=1), gpu_node("gpu-c", gpus=1)],
                          kubelet_nodes={"gpu-a"}, extra_env={"HAI_KUBERNETES__GANG_TIMEOUT_S": "3"})
    try:
        stack = ks.stack
        job = stack.submit(name="gang", nodes=2, gpus_per_node=1, command=["bash", "-c", "sleep 600"])
        wait_for(lambda: len(ks.job_pods(job["id"])) == 2, what="its pods")
        def requeued():
            j = stack.job(job["id"])
            ev = [e for e in j["events"] if e["to_state"] == "queued" and "gang timeout" in e["reason"]]
            return ev and (j, ev[0])

        queued, event = wait_for(requeued, timeout=60, what="the gang timeout to requeue it")
        assert "gang timeout: 1 of 2 pods running after 3s" in event["reason"]
        assert queued["state"] in ("queued", "starting")  # back in line (the scheduler may place it again)
        assert queued["failure_reason"] is None and queued["exit_code"] is None
        assert queued["restarts"] == 0 and queued["suspensions"] == 0 and queued["lost_gpu_s"] == 0
        wait_for(lambda: all(o["metadata"]["labels"]["hai.io/attempt"] != "1"
                             for kind in ("pods", "configmaps", "services") for o in ks.objects(kind, job["id"])),
                 timeout=60, what="attempt 1 torn down")
    finally:
        stop_kube_stack(ks)


def test_platform_restart_mid_job_adopts_its_pods(kube, tmp_path):
    """Level-triggered: a restarted backend rebuilds its view from the pods (no second pod, no
    lost outcome) and the job still succeeds."""
    from tests.e2e.conftest import stop_stack

    stack = kube.stack
    job = stack.submit(name="survivor", gpus_per_node=2,
                       command=["bash", "-c", "echo before; sleep 6; echo after"])
    stack.wait_state(job["id"], {"running"})
    wait_for(lambda: "before" in stack.logs(job["id"]), what="its first line")
    uid = kube.job_pods(job["id"])[0]["metadata"]["uid"]
    stop_stack(stack)  # the API server, the scheduler and the backend go away; the pod runs on
    assert [p["metadata"]["uid"] for p in kube.job_pods(job["id"])] == [uid]
    again = start_kube_stack(tmp_path, nodes=[], reuse=kube)
    kube.stack = again.stack
    done = again.stack.wait_state(job["id"], TERMINAL, timeout=90)
    assert done["state"] == "succeeded" and done["attempt"] == 1 and done["restarts"] == 0
    logs = again.stack.logs(job["id"])
    assert logs.count("before") == 1 and "after" in logs  # re-followed from the start, stored once
    assert kube.kubelet.started == 1  # never launched twice
    wait_for(lambda: _no_objects_left(kube, job["id"]), timeout=60, what="its objects to be deleted")
