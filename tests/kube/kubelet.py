"""A fake kubelet for the tests: it watches the pods bound to its nodes (through the official
client, like a kubelet watches the API server), moves them through their phases and really
runs each container's command as a local process with the container's environment.

What it emulates of a node:
- admission: the pods' ``nvidia.com/gpu`` limits must fit the Node's allocatable count, else the
  pod fails (UnexpectedAdmissionError), as the device plugin's admission does;
- volumes: emptyDir (a folder per pod), downwardAPI (files from the pod's annotations, rewritten
  as soon as they change: a real kubelet does it on its sync period), hostPath (the path
  itself); a mount path is emulated by rewriting it to the local folder in the container's
  env, command and working directory (there is no mount namespace here);
- cluster DNS: ``<service>.<namespace>.svc`` in the env resolves to 127.0.0.1 (every pod's IP);
- container status (running, terminated with its exit code), pod phase (Pending, Running,
  Succeeded, Failed), activeDeadlineSeconds;
- graceful deletion: SIGTERM to the container's main process (PID 1), SIGKILL to all of its
  processes after deletionGracePeriodSeconds, then the pod is removed (grace 0);
- logs: stdout and stderr of each container go to a file served by the emulator's pods/log.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from tests.kube.emulator import Cluster

log = logging.getLogger("fake-kubelet")
GPU = "nvidia.com/gpu"
NODE_WORKERS = 8  # threads handling the pods' events, each for a share of the nodes


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class SimProc:
    """A container that is not a process (benchmarks at 1,000 pods on a small machine): it writes
    one log line, 'runs' for ``runtime_s`` and exits 0; SIGTERM ends it with 143."""

    def __init__(self, runtime_s: float, log: Path) -> None:
        self.pid = -1
        self.returncode: int | None = None
        self.end = time.monotonic() + runtime_s
        log.write_text("simulated container ran\n")

    def poll(self) -> int | None:
        if self.returncode is None and time.monotonic() >= self.end:
            self.returncode = 0
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.returncode = -sig

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class Container:
    name: str
    proc: subprocess.Popen
    started_at: str
    exit_code: int | None = None
    finished_at: str | None = None


@dataclass
class PodRun:
    name: str
    uid: str
    node: str
    gpus: int
    dir: Path
    podinfo: dict[str, tuple[Path, str]] = field(default_factory=dict)  # file -> (path, annotation)
    containers: dict[str, Container] = field(default_factory=dict)
    term_at: float | None = None
    grace: float = 30.0
    killed: bool = False
    done: bool = False
    deadline: float | None = None
    annotations: dict = field(default_factory=dict)


class FakeKubelet:
    def __init__(self, cluster: Cluster, api: client.ApiClient, *, namespace: str, workdir: Path,
                 nodes: set[str] | None = None, run_processes: bool = True, sim_runtime_s: float = 1.0) -> None:
        self.cluster = cluster
        self.core = client.CoreV1Api(api)
        self.ns = namespace
        self.workdir = workdir
        self.nodes = nodes
        self.run_processes = run_processes
        self.sim_runtime_s = sim_runtime_s
        self.node_gpus: dict[str, int] = {}
        self.dns_cache: set[str] = set()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.runs: dict[str, PodRun] = {}
        self.started = 0
        self.rv: str | None = None
        self.threads: list[threading.Thread] = []
        self.queues: list[queue.Queue] = [queue.Queue() for _ in range(NODE_WORKERS)]
        self.base_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR", "VIRTUAL_ENV") if k in os.environ}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FakeKubelet":
        self._learn_nodes()
        for target in (self._watch_loop, self._supervise_loop):
            t = threading.Thread(target=target, daemon=True, name=f"fake-kubelet-{target.__name__}")
            t.start()
            self.threads.append(t)
        for i, q in enumerate(self.queues):
            t = threading.Thread(target=self._node_worker, args=(q,), daemon=True, name=f"fake-kubelet-nodes-{i}")
            t.start()
            self.threads.append(t)
        return self

    def _learn_nodes(self) -> None:
        """Each node's allocatable GPUs, from one list (a kubelet knows its own node; one GET per
        node on its first pod was 1,250 requests in the scale benchmark). A node added later is
        read when its first pod arrives."""
        try:
            for n in json.loads(self.core.list_node(_preload_content=False).data).get("items") or []:
                self.node_gpus[n["metadata"]["name"]] = int(
                    ((n.get("status") or {}).get("allocatable") or {}).get(GPU, 0) or 0)
        except ApiException as e:
            log.warning("fake kubelet: listing the nodes: %r", e)

    def close(self) -> None:
        self.stop.set()
        for q in self.queues:
            q.put(None)
        with self.lock:
            runs = list(self.runs.values())
        for run in runs:
            for c in run.containers.values():
                self._kill_group(c.proc)
        for t in self.threads:
            t.join(10)

    # ------------------------------------------------------------------ watching pods
    def _watch_loop(self) -> None:
        while not self.stop.is_set():
            try:
                data = json.loads(self.core.list_namespaced_pod(self.ns, _preload_content=False).data)
                self.rv = data["metadata"]["resourceVersion"]
                for pod in data["items"]:
                    self._dispatch("ADDED", pod)
                while not self.stop.is_set():
                    resp = self.core.list_namespaced_pod(self.ns, watch=True, resource_version=self.rv,
                                                         timeout_seconds=5, _preload_content=False)
                    for line in iter_resp_lines(resp):
                        if not line:
                            continue
                        ev = json.loads(line)
                        if ev["type"] == "ERROR":
                            raise ApiException(status=ev["object"].get("code"))
                        self.rv = ev["object"]["metadata"].get("resourceVersion", self.rv)
                        self._dispatch(ev["type"], ev["object"])
                        if self.stop.is_set():
                            break
            except Exception as e:
                if not self.stop.is_set():
                    log.warning("fake kubelet watch: %r", e)
                    self.stop.wait(0.5)

    def _dispatch(self, typ: str, pod: dict) -> None:
        """To the worker of the pod's node: the pods of one node are handled in the order of
        their events, by one thread (as by that node's kubelet), the nodes side by side (as
        kubelets are: one thread for every node's pods started them one after the other)."""
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (self.nodes is not None and node not in self.nodes):
            return
        self.queues[zlib.crc32(node.encode()) % len(self.queues)].put((typ, pod))

    def _node_worker(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None or self.stop.is_set():
                return
            try:
                self._handle(*item)
            except Exception as e:
                log.warning("fake kubelet: %s: %r", item[1]["metadata"].get("name"), e)

    def _handle(self, typ: str, pod: dict) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node or (self.nodes is not None and node not in self.nodes):
            return
        name = meta["name"]
        with self.lock:
            run = self.runs.get(name)
        if typ == "DELETED":
            if run is not None:
                for c in run.containers.values():
                    self._kill_group(c.proc)
                self._forget(run)
            return
        if run is not None and run.uid != meta["uid"]:
            self._forget(run)
            run = None
        phase = (pod.get("status") or {}).get("phase")
        if run is None:
            if phase in ("Succeeded", "Failed"):
                return  # ran before this kubelet started: nothing to do here
            if meta.get("deletionTimestamp"):
                self._remove(name)
                return
            self._start(pod)
            return
        self._update_podinfo(run, meta.get("annotations") or {})
        if meta.get("deletionTimestamp") and run.term_at is None:
            run.grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            run.term_at = time.monotonic()
            for c in run.containers.values():
                if c.exit_code is None:
                    try:
                        c.proc.send_signal(signal.SIGTERM)  # PID 1 of the container
                    except OSError:
                        pass
            if not run.containers or run.done:
                self._finish_deletion(run)

    # ------------------------------------------------------------------ starting
    def _gpus_of(self, pod: dict) -> int:
        total = 0
        for c in (pod.get("spec") or {}).get("containers") or []:
            limits = (c.get("resources") or {}).get("limits") or {}
            total += int(limits.get(GPU, 0) or 0)
        return total

    def _node_gpus(self, node: str) -> int | None:
        if node in self.node_gpus:
            return self.node_gpus[node]
        try:
            n = json.loads(self.core.read_node(node, _preload_content=False).data)
        except ApiException:
            return None
        self.node_gpus[node] = int(((n.get("status") or {}).get("allocatable") or {}).get(GPU, 0) or 0)
        return self.node_gpus[node]

    def _patch_status(self, name: str, status: dict) -> None:
        try:
            self.core.patch_namespaced_pod_status(name, self.ns, {"status": status}, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    def _start(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        name, node = meta["name"], spec["nodeName"]
        gpus = self._gpus_of(pod)
        allocatable = self._node_gpus(node)
        with self.lock:
            used = sum(r.gpus for r in self.runs.values() if r.node == node and not r.done)
        if allocatable is None or used + gpus > allocatable:
            self._patch_status(name, {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                                      "message": f"Allocate failed: requested {gpus} {GPU}, "
                                                 f"{(allocatable or 0) - used} available on node {node}"})
            return
        pdir = self.workdir / "pods" / meta["uid"]
        pdir.mkdir(parents=True, exist_ok=True)
        run = PodRun(name=name, uid=meta["uid"], node=node, gpus=gpus, dir=pdir)
        vol_paths: dict[str, Path] = {}
        for v in spec.get("volumes") or []:
            if "emptyDir" in v:
                p = pdir / "volumes" / v["name"]
                p.mkdir(parents=True, exist_ok=True)
            elif "downwardAPI" in v:
                p = pdir / "volumes" / v["name"]
                p.mkdir(parents=True, exist_ok=True)
                for item in v["downwardAPI"].get("items") or []:
                    m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", item["fieldRef"]["fieldPath"])
                    if m:
                        run.podinfo[item["path"]] = (p / item["path"], m.group(1))
            elif "hostPath" in v:
                p = Path(v["hostPath"]["path"])
                p.mkdir(parents=True, exist_ok=True)
            else:
                raise AssertionError(f"fake kubelet: unsupported volume {v}")
            vol_paths[v["name"]] = p
        self._update_podinfo(run, meta.get("annotations") or {}, force=True)
        with self.lock:
            self.runs[name] = run
        if spec.get("activeDeadlineSeconds"):
            run.deadline = time.monotonic() + float(spec["activeDeadlineSeconds"])
        statuses = []
        for c in spec["containers"]:
            mounts = sorted(((m["mountPath"], str(vol_paths[m["name"]])) for m in c.get("volumeMounts") or []),
                            key=lambda t: -len(t[0]))

            def local(value: str) -> str:
                for mp, lp in mounts:
                    if value == mp or value.startswith(mp.rstrip("/") + "/"):
                        return lp + value[len(mp):]
                return value

            env = dict(self.base_env)
            for e in c.get("env") or []:
                if "value" in e:
                    env[e["name"]] = self._dns(local(str(e["value"])))
                elif "valueFrom" in e and "fieldRef" in e["valueFrom"]:
                    path = e["valueFrom"]["fieldRef"]["fieldPath"]
                    env[e["name"]] = {"metadata.name": name, "metadata.namespace": self.ns, "spec.nodeName": node,
                                      "status.podIP": "127.0.0.1", "metadata.uid": meta["uid"]}.get(path, "")
            argv = [local(a) for a in (c.get("command") or []) + (c.get("args") or [])]
            logfile = pdir / f"{c['name']}.log"
            cwd = local(c["workingDir"]) if c.get("workingDir") else str(pdir)
            if self.run_processes:
                with open(logfile, "ab") as out:
                    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
            else:
                proc = SimProc(self.sim_runtime_s, logfile)  # type: ignore[assignment]
            self.cluster.set_log(self.ns, name, c["name"], logfile)
            started = _now()
            run.containers[c["name"]] = Container(name=c["name"], proc=proc, started_at=started)
            statuses.append({"name": c["name"], "ready": True, "restartCount": 0, "image": c.get("image", ""),
                             "started": True, "state": {"running": {"startedAt": started}}})
        with self.lock:
            self.started += 1
        self._patch_status(name, {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1", "startTime": _now(),
                                  "conditions": [{"type": "Ready", "status": "True"}], "containerStatuses": statuses})

    def _dns(self, value: str) -> str:
        m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc(\.cluster\.local)?", value)
        if not m:
            return value
        if value in self.dns_cache:
            return "127.0.0.1"
        try:
            self.core.read_namespaced_service(m.group(1), m.group(2), _preload_content=False)
        except ApiException:
            return value
        self.dns_cache.add(value)
        return "127.0.0.1"

    def _update_podinfo(self, run: PodRun, annotations: dict, *, force: bool = False) -> None:
        if not force and annotations == run.annotations:
            return
        run.annotations = dict(annotations)
        for _, (path, key) in run.podinfo.items():
            value = annotations.get(key) or ""
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(value)
            os.replace(tmp, path)

    # ------------------------------------------------------------------ supervising
    def _kill_group(self, proc: subprocess.Popen) -> None:
        if isinstance(proc, SimProc):
            if proc.poll() is None:
                proc.kill()
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def _supervise_loop(self) -> None:
        while not self.stop.wait(0.05):
            with self.lock:
                runs = list(self.runs.values())
            for run in runs:
                try:
                    self._supervise(run)
                except Exception as e:
                    log.warning("fake kubelet: %s: %r", run.name, e)

    def _supervise(self, run: PodRun) -> None:
        if run.done and run.term_at is None:
            return
        changed = False
        now = time.monotonic()
        if run.deadline is not None and now >= run.deadline and not run.killed:
            run.killed = True
            for c in run.containers.values():
                self._kill_group(c.proc)
        if run.term_at is not None and not run.killed and now - run.term_at >= run.grace:
            run.killed = True
            for c in run.containers.values():
                self._kill_group(c.proc)
        for c in run.containers.values():
            if c.exit_code is None:
                rc = c.proc.poll()
                if rc is not None:
                    c.exit_code = 128 - rc if rc < 0 else rc
                    c.finished_at = _now()
                    self._kill_group(c.proc)  # the runtime stops what the container left behind
                    changed = True
        if not changed and not (run.term_at is not None and run.done):
            return
        all_done = all(c.exit_code is not None for c in run.containers.values())
        statuses = []
        for c in run.containers.values():
            if c.exit_code is None:
                statuses.append({"name": c.name, "ready": True, "restartCount": 0, "started": True,
                                 "state": {"running": {"startedAt": c.started_at}}})
            else:
                statuses.append({"name": c.name, "ready": False, "restartCount": 0, "started": False,
                                 "state": {"terminated": {"exitCode": c.exit_code, "startedAt": c.started_at,
                                                          "finishedAt": c.finished_at,
                                                          "reason": "Completed" if c.exit_code == 0 else "Error"}}})
        status: dict = {"containerStatuses": statuses}
        if all_done and not run.done:
            run.done = True
            ok = all(c.exit_code == 0 for c in run.containers.values())
            status["phase"] = "Succeeded" if ok else "Failed"
            if run.deadline is not None and now >= run.deadline and not ok:
                status["reason"] = "DeadlineExceeded"
            status["conditions"] = [{"type": "Ready", "status": "False"}]
            for c in run.containers.values():
                src = self.cluster.emu.logs.get((self.ns, run.name, c.name))
                if src is not None:
                    src.done = True
        if changed:
            self._patch_status(run.name, status)
        if run.done and run.term_at is not None:
            self._finish_deletion(run)

    def _finish_deletion(self, run: PodRun) -> None:
        self._remove(run.name)
        self._forget(run)

    def _remove(self, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    def _forget(self, run: PodRun) -> None:
        with self.lock:
            if self.runs.get(run.name) is run:
                del self.runs[run.name]
        for c in run.containers.values():
            src = self.cluster.emu.logs.get((self.ns, run.name, c.name))
            if src is not None:
                src.done = True
        shutil.rmtree(run.dir / "volumes", ignore_errors=True)

    def alive_processes(self) -> int:
        with self.lock:
            return sum(1 for r in self.runs.values() for c in r.containers.values() if c.proc.poll() is None)


def gpu_node(name: str, *, gpus: int = 8, zone: str = "A", leaf: str = "A1", ready: bool = True,
             unschedulable: bool = False, leaf_label: str = "hai.io/leaf") -> dict:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone, leaf_label: leaf,
                                              "nvidia.com/gpu.product": "NVIDIA-A100-PCIE-40GB",
                                              "nvidia.com/gpu.memory": "40960"}},
        "spec": {"unschedulable": unschedulable},
        "status": {"allocatable": {GPU: str(gpus), "cpu": "64", "memory": "512Gi"},
                   "capacity": {GPU: str(gpus)},
                   "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                   "reason": "KubeletReady" if ready else "KubeletNotReady"}]},
    }
