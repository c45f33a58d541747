"""The pieces under the Kubernetes backend: the emulator's filled gaps (selectors,
resourceVersion watches, 410, graceful delete, garbage collection), the backend's informer, the
object translations and the in-pod wrapper with the unchanged SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from hai.integrations.kubernetes import objects as ob
from hai.integrations.kubernetes.backend import Informer
from hai.integrations.kubernetes.podwrap import EVENT_PREFIX
from hai.protocol import Assignment, LaunchSpec
from tests.e2e.conftest import wait_for
from tests.kube.emulator import Cluster, api_for, labels_match, parse_label_selector
from tests.kube.kubelet import gpu_node

NS = "hai-jobs"


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path).start()
    yield c
    c.stop()


@pytest.fixture
def core(cluster):
    return client.CoreV1Api(api_for(cluster))


def _pod(name: str, labels: dict | None = None, node: str | None = "n1", owner: dict | None = None) -> dict:
    meta: dict = {"name": name, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [owner]
    spec: dict = {"containers": [{"name": "c", "image": "x"}], "terminationGracePeriodSeconds": 7}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _names(resp) -> list[str]:
    return sorted(o["metadata"]["name"] for o in json.loads(resp.data)["items"])


def test_label_selector_parsing():
    reqs = parse_label_selector("a=1,b!=2,c,!d,e in (x, y),f notin (z)")
    assert labels_match({"a": "1", "c": "", "e": "y", "f": "q"}, reqs)
    assert not labels_match({"a": "1", "c": "", "e": "y", "f": "z"}, reqs)
    assert not labels_match({"a": "1", "b": "2", "c": "", "e": "x"}, reqs)
    assert not labels_match({"a": "1", "c": "", "d": "", "e": "x"}, reqs)


def test_list_filters_by_label_and_field_selectors(core):
    core.create_namespaced_pod(NS, _pod("a", {"app": "x", "tier": "1"}, node="n1"))
    core.create_namespaced_pod(NS, _pod("b", {"app": "x"}, node="n2"))
    core.create_namespaced_pod(NS, _pod("c", {"app": "y"}, node="n1"))
    core.create_namespaced_pod("other", _pod("d", {"app": "x"}))
    assert _names(core.list_namespaced_pod(NS, label_selector="app=x", _preload_content=False)) == ["a", "b"]
    assert _names(core.list_namespaced_pod(NS, label_selector="app=x,!tier", _preload_content=False)) == ["b"]
    assert _names(core.list_namespaced_pod(NS, field_selector="spec.nodeName=n1", _preload_content=False)) == ["a", "c"]
    assert _names(core.list_pod_for_all_namespaces(label_selector="app=x", _preload_content=False)) == ["a", "b", "d"]
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(NS, _pod("a"))
    assert e.value.status == 409
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod("nope", NS)
    assert e.value.status == 404


def test_informer_resumes_its_watch_from_the_last_resource_version(cluster, core):
    events: list[tuple[str, str]] = []
    stop = threading.Event()
    inf = Informer("pods", lambda **kw: core.list_namespaced_pod(NS, **kw),
                   on_event=lambda t, o, old: events.append((t, o["metadata"]["name"])), stop=stop,
                   resync_s=3600, watch_timeout_s=1, label_selector="app=x")
    core.create_namespaced_pod(NS, _pod("a", {"app": "x"}))
    inf.relist()
    assert events == [("ADDED", "a")] and inf.lists == 1
    listed_rv = int(inf.rv)
    core.create_namespaced_pod(NS, _pod("b", {"app": "x"}))
    core.create_namespaced_pod(NS, _pod("ignored", {"app": "y"}))  # not selected
    core.patch_namespaced_pod("a", NS, {"metadata": {"annotations": {"k": "v"}}})
    inf.watch_once()  # the server ends it after 1 s; only the changes after the list come
    assert events[1:] == [("ADDED", "b"), ("MODIFIED", "a")]
    assert int(inf.rv) > listed_rv
    core.delete_namespaced_pod("b", NS, grace_period_seconds=0)
    inf.watch_once()  # resumed from where the last one ended: nothing replayed twice
    assert events[3:] == [("DELETED", "b")]
    assert set(inf.objects) == {"a"} and inf.lists == 1 and inf.watches == 2

    # the history is compacted: resuming from an old version is refused with 410 Gone ...
    cluster.call(cluster.emu.compact)
    inf.rv = str(listed_rv)
    with pytest.raises(ApiException) as e:
        inf.watch_once()
    assert e.value.status == 410
    # ... and run() re-lists on 410 and carries on watching
    core.create_namespaced_pod(NS, _pod("c", {"app": "x"}))
    t = threading.Thread(target=inf.run, daemon=True)
    t.start()
    wait_for(lambda: inf.get("c") is not None and inf.lists == 2, timeout=10, what="a re-list after 410")
    stop.set()
    t.join(5)


def test_graceful_pod_deletion_and_cascade_over_owner_references(core):
    parent = json.loads(core.create_namespaced_config_map(
        NS, {"metadata": {"name": "p"}, "data": {}}, _preload_content=False).data)
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "p", "uid": parent["metadata"]["uid"]}
    core.create_namespaced_pod(NS, _pod("bound", owner=owner))
    core.create_namespaced_pod(NS, _pod("unbound", owner=owner, node=None))
    core.create_namespaced_service(NS, {"metadata": {"name": "s", "ownerReferences": [owner]},
                                        "spec": {"clusterIP": "None", "selector": {"a": "b"}}})
    core.delete_namespaced_config_map("p", NS)
    # a bound pod terminates gracefully (its kubelet finishes the deletion); the rest goes at once
    bound = core.read_namespaced_pod("bound", NS)
    assert bound.metadata.deletion_timestamp is not None and bound.metadata.deletion_grace_period_seconds == 7
    for read in (lambda: core.read_namespaced_pod("unbound", NS), lambda: core.read_namespaced_service("s", NS)):
        with pytest.raises(ApiException) as e:
            read()
        assert e.value.status == 404
    core.delete_namespaced_pod("bound", NS, grace_period_seconds=0)
    assert _names(core.list_namespaced_pod(NS, _preload_content=False)) == []


def _assignment(job_type="torch", gpus=2, node_rank=1, nnodes=2, action="run") -> Assignment:
    return Assignment(job_id=7, attempt=3, action=action, spec=LaunchSpec(
        job_name="t", user="alice", command=["python", "train.py"], env={"FOO": "1", "RANK": "99"},
        job_type=job_type, gpus=list(range(gpus)), node_rank=node_rank, nnodes=nnodes, gpus_per_node=gpus,
        master_addr="x", master_port=29555, restart_count=2, resume_from="/ck/7/step-10", suspend_grace_s=30))


def test_pod_for_an_assignment_has_the_job_type_environment():
    parent = {"metadata": {"name": "hai-j7-a3", "uid": "u-1"}}
    pod = ob.attempt_pod(_assignment(), node="gpu-1", namespace=NS, parent=parent, image="img", python="python3",
                         gpu_resource="nvidia.com/gpu", checkpoint_claim="ckpt", stop_grace_s=12)
    spec = pod["spec"]
    assert spec["nodeName"] == "gpu-1" and spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 12
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert pod["metadata"]["labels"][ob.NODE_RANK_LABEL] == "1"
    assert [c["name"] for c in spec["containers"]] == ["rank-2", "rank-3"]
    env = {e["name"]: e["value"] for e in spec["containers"][1]["env"]}
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["NODE_RANK"] == "1" and env["NNODES"] == "2" and env["MASTER_PORT"] == "29555"
    assert env["MASTER_ADDR"] == "hai-j7-a3.hai-jobs.svc"
    assert env["HAI_RESUME_FROM"] == "/ck/7/step-10" and env["HAI_RESTART_COUNT"] == "2"
    assert env["HAI_CHECKPOINT_DIR"] == "/hai/checkpoints/7/checkpoints" and env["FOO"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin sets it
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert spec["containers"][0]["command"][:4] == ["python3", "-m", "hai.integrations.kubernetes.podwrap", "--"]
    assert {"name": "hai-checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in spec["volumes"]
    # a command job: one container with all the node's GPUs of the attempt
    pod = ob.attempt_pod(_assignment("command", gpus=4), node="gpu-1", namespace=NS, parent=parent, image="img",
                         python="python3", gpu_resource="nvidia.com/gpu")
    assert [c["resources"]["limits"] for c in pod["spec"]["containers"]] == [{"nvidia.com/gpu": "4"}]


def test_pod_status_maps_to_rank_statuses():
    pod = {"spec": {"containers": [{"name": "rank-0"}, {"name": "rank-1"}]},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "rank-0", "state": {"terminated": {"exitCode": 3, "startedAt": "2026-01-01T00:00:00Z"}}},
               {"name": "rank-1", "state": {"running": {"startedAt": "2026-01-01T00:00:01Z"}}}]}}
    ranks, err, started, _ = ob.pod_ranks(pod)
    assert [(r.rank, r.state, r.exit_code) for r in ranks] == [(0, "exited", 3), (1, "running", None)]
    assert err is None and started is not None and not ob.pod_finished(pod)
    pull = {"spec": {"containers": [{"name": "rank-0"}]}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "rank-0", "state": {"waiting": {"reason": "ErrImagePull", "message": "no such image"}}}]}}
    assert "ErrImagePull" in ob.pod_ranks(pull)[1] and ob.pod_finished(pull)
    admission = {"spec": {"containers": [{"name": "rank-0"}]},
                 "status": {"phase": "Failed", "reason": "UnexpectedAdmissionError"}}
    assert "UnexpectedAdmissionError" in ob.pod_ranks(admission)[1]


def test_node_maps_to_hello_and_state():
    node = gpu_node("g1", gpus=8, zone="B", leaf="B7")
    hello = ob.node_hello(node, zone_label="topology.kubernetes.io/zone", leaf_label="hai.io/leaf",
                          gpu_resource="nvidia.com/gpu")
    assert (hello.node, hello.zone, hello.leaf, len(hello.gpus), hello.address) == ("g1", "B", "B7", 8, "127.0.0.1")
    assert hello.gpus[0].model == "NVIDIA-A100-PCIE-40GB" and hello.gpus[0].memory_total_mib == 40960
    assert ob.node_condition(node) == ("ready", "")
    assert ob.node_condition(gpu_node("g2", unschedulable=True))[0] == "drained"
    assert ob.node_condition(gpu_node("g3", ready=False))[0] == "unhealthy"


def test_podwrap_bridges_the_unchanged_sdk(tmp_path):
    control, podinfo = tmp_path / "control", tmp_path / "podinfo"
    podinfo.mkdir()
    (podinfo / "suspend").write_text("")  # a downwardAPI file of an absent annotation is empty
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from hai import sdk
        print("training", flush=True)
        while not sdk.should_suspend():
            time.sleep(0.02)
        sdk.report_checkpoint("/ck/step-5", step=5)
        sdk.suspend_ready()
        print("suspended", flush=True)
        sys.exit(7)
    """))
    env = {**os.environ, "HAI_CONTROL_DIR": str(control), "HAI_PODINFO_DIR": str(podinfo), "RANK": "3"}
    proc = subprocess.Popen([sys.executable, "-m", "hai.integrations.kubernetes.podwrap", "--", sys.executable,
                             str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "training"
    assert not (control / "suspend").exists()
    (podinfo / "suspend").write_text(ob.suspend_value(123.0, 30))  # the annotation is set
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 7  # the container's exit code is the rank's
    events = [json.loads(line[len(EVENT_PREFIX):]) for line in out.split("\n") if line.startswith(EVENT_PREFIX)]  # (\x1e splits str.splitlines)
    assert [e["type"] for e in events] == ["checkpoint", "suspend_ready"]
    assert events[0]["step"] == 5 and events[1]["rank"] == 3
    assert "suspended" in out


def test_cordon_and_uncordon_for_the_platform_drain(cluster, core, monkeypatch):
    from hai.integrations.kubernetes import backend
    from hai.settings import get_settings

    core.create_node(gpu_node("n1"))
    monkeypatch.setenv("HAI_KUBERNETES__KUBECONFIG", str(cluster.kubeconfig))
    get_settings.cache_clear()
    try:
        backend.cordon("n1", "drained by admin: GPU 3 ECC errors")
        node = json.loads(core.read_node("n1", _preload_content=False).data)
        assert node["spec"]["unschedulable"] is True
        assert ob.node_condition(node) == ("drained", "drained by admin: GPU 3 ECC errors")
        backend.uncordon("n1")
        node = json.loads(core.read_node("n1", _preload_content=False).data)
        assert ob.node_condition(node) == ("ready", "")
        assert ob.CORDON_ANNOTATION not in (node["metadata"].get("annotations") or {})
    finally:
        get_settings.cache_clear()
