"""The Kubernetes execution backend: a level-triggered reconciler that acts as an in-process fleet
of virtual agents, one per Kubernetes Node.

Each pass: every Kubernetes Node is registered like an agent (GPUs from allocatable
``nvidia.com/gpu``, zone/leaf from labels; cordon and readiness mirrored onto the platform node);
every node with work sends a heartbeat whose attempt statuses come from its pods (container exit
codes are the ranks' exit codes) and gets the node's full assignments back (run / suspend / stop),
which become pods, a suspend annotation, or pod deletions with a grace period. The server side
(``services/agents``) applies the same job-outcome rules as for agents.

Caches are fed by informers (list, then watch from the list's resourceVersion; a watch that ends
resumes from the last resourceVersion it saw; 410 Gone and every ``resync_s`` re-list).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from hai.integrations.kubernetes import objects as ob
from hai.integrations.kubernetes import platform as plat
from hai.integrations.kubernetes.podwrap import EVENT_PREFIX
from hai.protocol import (
    AgentHello,
    Assignment,
    AttemptStatus,
    CheckpointInfo,
    Heartbeat,
    LogBatch,
    LogLine,
    ProgressInfo,
    RankStatus,
    ServerReply,
)
from hai.services.context import Platform
from hai.settings import KubernetesSettings

log = logging.getLogger(__name__)

# at most this many nodes' heartbeats in one transaction (a pass splits its nodes into one batch
# per worker up to this size)
HEARTBEAT_BATCH = 32
READY_EXIT_WINDOW_S = 2.0  # as the agent: after suspend_ready(), ranks get this long to exit
SIGKILL_EXIT = 137


def make_api(settings: KubernetesSettings, *, pool: int = 64) -> k8s.CoreV1Api:
    """CoreV1Api from the kubeconfig (settings.kubeconfig) or the in-cluster configuration."""
    cfg = k8s.Configuration()
    if settings.kubeconfig:
        k8s_config.load_kube_config(config_file=settings.kubeconfig, context=settings.context or None,
                                    client_configuration=cfg)
    else:
        k8s_config.load_incluster_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    return k8s.CoreV1Api(k8s.ApiClient(cfg))


def _json(resp) -> Any:
    return json.loads(resp.data)


# -- informers -------------------------------------------------------------------------------
class Informer:
    """A cache of one kind of object: list, then watch from the list's resourceVersion."""

    def __init__(self, name: str, list_fn: Callable[..., Any], *, on_event: Callable[[str, dict, dict | None], None],
                 stop: threading.Event, resync_s: float, watch_timeout_s: int, label_selector: str = "") -> None:
        self.name = name
        self.list_fn = list_fn
        self.on_event = on_event
        self.stop = stop
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        self.label_selector = label_selector
        self.lock = threading.Lock()
        self.objects: dict[str, dict] = {}
        self.rv: str | None = None
        self.synced = threading.Event()
        self.lists = 0
        self.watches = 0
        self._resp = None

    def snapshot(self) -> list[dict]:
        with self.lock:
            return list(self.objects.values())

    def get(self, name: str) -> dict | None:
        with self.lock:
            return self.objects.get(name)

    def _kw(self) -> dict:
        return {"label_selector": self.label_selector} if self.label_selector else {}

    def relist(self) -> None:
        data = _json(self.list_fn(**self._kw(), _preload_content=False))
        items = {o["metadata"]["name"]: o for o in data.get("items") or []}
        with self.lock:
            old = self.objects
            self.objects = items
            self.rv = (data.get("metadata") or {}).get("resourceVersion")
        self.lists += 1
        for name, obj in old.items():
            if name not in items:
                self.on_event("DELETED", obj, obj)
        for name, obj in items.items():
            self.on_event("MODIFIED" if name in old else "ADDED", obj, old.get(name))
        self.synced.set()

    def watch_once(self) -> None:
        """One watch request from self.rv; returns when the server ends it (timeout)."""
        resp = self.list_fn(**self._kw(), watch=True, resource_version=self.rv, allow_watch_bookmarks=True,
                            timeout_seconds=self.watch_timeout_s, _preload_content=False,
                            _request_timeout=self.watch_timeout_s + 15)
        self._resp = resp
        self.watches += 1
        try:
            for line in iter_resp_lines(resp):
                if self.stop.is_set():
                    return
                if not line:
                    continue
                ev = json.loads(line)
                typ, obj = ev.get("type"), ev.get("object") or {}
                if typ == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if typ == "BOOKMARK":
                    self.rv = rv or self.rv
                    continue
                name = obj["metadata"]["name"]
                with self.lock:
                    old = self.objects.get(name)
                    if typ == "DELETED":
                        self.objects.pop(name, None)
                    else:
                        self.objects[name] = obj
                    if rv:
                        self.rv = rv
                self.on_event(typ, obj, old)
        finally:
            self._resp = None
            resp.release_conn()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.relist()
                listed = time.monotonic()
                while not self.stop.is_set() and time.monotonic() - listed < self.resync_s:
                    self.watch_once()
            except ApiException as e:
                if e.status == 410:
                    log.info("%s: resourceVersion %s expired; re-listing", self.name, self.rv)
                    continue
                log.warning("%s informer: %s", self.name, e)
                self.stop.wait(1.0)
            except Exception as e:  # connection errors: back off, then list again
                if self.stop.is_set():
                    return
                log.warning("%s informer: %s", self.name, e)
                self.stop.wait(1.0)

    def close(self) -> None:
        resp = self._resp
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:
                pass


# -- per pod runtime state -------------------------------------------------------------------

# how long a rank whose container ended is still reported running while its log is being read
LOG_DRAIN_S = 30.0


@dataclass
class PodRuntime:
    """What the backend knows about one pod beyond its object: SDK events and its own stops.
    Rebuilt after a restart: stop and suspend from the pod's annotations, events from its logs."""

    job_id: int
    attempt: int
    node: str
    created: bool = False
    suspend_requested_at: float | None = None
    ready_at: float | None = None  # when the backend saw suspend_ready()
    rank_ready: dict[int, float] = field(default_factory=dict)
    checkpoint: CheckpointInfo | None = None
    progress: ProgressInfo | None = None
    stop_cause: str | None = None
    stopped_reason: str | None = None
    stop_sent_at: float | None = None
    followed: set[str] = field(default_factory=set)  # containers whose log is followed
    drained: set[str] = field(default_factory=set)  # containers whose log was read to its end and shipped
    last_output_at: float | None = None


def _annotation(pod: dict, key: str) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(key)


class KubernetesBackend:
    def __init__(self, platform: Platform, api: k8s.CoreV1Api | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.platform = platform
        self.cfg: KubernetesSettings = platform.settings.kubernetes
        self.api = api or make_api(self.cfg)
        self.ns = self.cfg.namespace
        self.clock = clock
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self.lock = threading.RLock()
        self.runtime: dict[str, PodRuntime] = {}  # by pod name
        self.tombstones: dict[tuple[str, int, int], AttemptStatus] = {}  # (node, job, attempt)
        self.registered: dict[str, AgentHello] = {}
        self.replies: dict[str, ServerReply] = {}
        self.applied_digest: dict[str, str] = {}
        self.last_hb: dict[str, float] = {}
        self.fingerprints: dict[str, int] = {}  # per node, of the assignments of its last reply
        self.sent: dict[str, list] = {}  # per node, the attempt reports of its last heartbeat
        self.dirty: set[str] = set()
        self.node_state_seen: dict[str, tuple[str, str]] = {}
        self.parents: dict[tuple[int, int], dict] = {}
        self.gang_ok: set[tuple[int, int]] = set()
        self.gang_requeued: set[tuple[int, int]] = set()
        self.log_buf: list[LogLine] = []
        self.log_drains: list[tuple[PodRuntime, str]] = []  # containers whose log ended, once shipped
        self.log_lock = threading.Lock()
        self.log_wake = threading.Event()
        self.passes = 0
        self.heartbeats = 0
        self.pods_created = 0
        self.timings: dict[str, float] = {}  # seconds spent, by kind of work (benchmarks)
        self.threads: list[threading.Thread] = []
        self.pool = ThreadPoolExecutor(max_workers=self.cfg.heartbeat_workers, thread_name_prefix="hai-k8s-hb")
        common = dict(stop=self.stop_event, resync_s=self.cfg.resync_s, watch_timeout_s=self.cfg.watch_timeout_s)
        managed = f"{ob.MANAGED_BY}=hai"
        self.nodes = Informer("nodes", self.api.list_node, on_event=self._on_node, label_selector=self.cfg.node_selector,
                              **common)
        self.pods = Informer("pods", lambda **kw: self.api.list_namespaced_pod(self.ns, **kw), on_event=self._on_pod,
                             label_selector=managed, **common)
        self.configmaps = Informer("configmaps", lambda **kw: self.api.list_namespaced_config_map(self.ns, **kw),
                                   on_event=self._on_parent, label_selector=managed, **common)
        self.keepalive_s = min(10.0, platform.settings.agent.lost_after_s / 3)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for inf in (self.nodes, self.pods, self.configmaps):
            t = threading.Thread(target=inf.run, name=f"hai-k8s-{inf.name}", daemon=True)
            t.start()
            self.threads.append(t)
        for target, name in ((self._reconcile_loop, "reconcile"), (self._log_loop, "logs")):
            t = threading.Thread(target=target, name=f"hai-k8s-{name}", daemon=True)
            t.start()
            self.threads.append(t)

    def close(self) -> None:
        self.stop_event.set()
        self.wake.set()
        self.log_wake.set()
        for inf in (self.nodes, self.pods, self.configmaps):
            inf.close()
        for t in self.threads:
            t.join(5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self._flush_logs()

    def run_forever(self) -> None:
        self.start()
        try:
            while not self.stop_event.wait(1.0):
                pass
        finally:
            self.close()

    # ------------------------------------------------------------------ informer callbacks
    def _mark(self, node: str | None) -> None:
        if node:
            with self.lock:
                self.dirty.add(node)
        self.wake.set()

    def _on_node(self, typ: str, obj: dict, old: dict | None) -> None:
        self._mark(obj["metadata"]["name"])

    def _on_parent(self, typ: str, obj: dict, old: dict | None) -> None:
        key = ob.key_of(obj)
        if key is None:
            return
        with self.lock:
            if typ == "DELETED":
                self.parents.pop(key, None)
            else:
                self.parents[key] = obj
        self.wake.set()

    def _rt(self, pod: dict) -> PodRuntime | None:
        key = ob.key_of(pod)
        if key is None:
            return None
        name = pod["metadata"]["name"]
        node = (pod.get("spec") or {}).get("nodeName") or ""
        with self.lock:
            rt = self.runtime.get(name)
            if rt is None:
                rt = self.runtime[name] = PodRuntime(job_id=key[0], attempt=key[1], node=node, created=True)
            # after a restart, what the pod's annotations remember
            if rt.suspend_requested_at is None:
                raw = _annotation(pod, ob.SUSPEND_ANNOTATION)
                if raw:
                    try:
                        rt.suspend_requested_at = float(json.loads(raw)["requested_at"])
                    except (ValueError, KeyError, TypeError):
                        pass
            if rt.stop_cause is None:
                raw = _annotation(pod, ob.STOP_ANNOTATION)
                if raw:
                    try:
                        d = json.loads(raw)
                        rt.stop_cause, rt.stopped_reason, rt.stop_sent_at = d["cause"], d["reason"], float(d["at"])
                    except (ValueError, KeyError, TypeError):
                        pass
            return rt

    def _on_pod(self, typ: str, obj: dict, old: dict | None) -> None:
        rt = self._rt(obj)
        if rt is None:
            return
        node = rt.node
        if typ == "DELETED":
            last = obj
            st = self._pod_status(last, rt, gone=True)
            with self.lock:
                self.tombstones[(node, rt.job_id, rt.attempt)] = st
                self.runtime.pop(obj["metadata"]["name"], None)
        elif self.cfg.follow_logs:
            self._follow(obj, rt)
        self._mark(node)

    # ------------------------------------------------------------------ statuses
    def _pod_status(self, pod: dict, rt: PodRuntime, *, gone: bool = False) -> AttemptStatus:
        ranks, error, started, finished_at = ob.pod_ranks(pod)
        stopped_reason, stop_cause = rt.stopped_reason, rt.stop_cause
        finished = ob.pod_finished(pod)
        if gone:
            # the pod object is gone: nothing of it runs any more
            seen = {r.rank for r in ranks}
            ranks = [r if r.state == "exited" else RankStatus(rank=r.rank, local_rank=r.local_rank, state="exited",
                                                               exit_code=SIGKILL_EXIT) for r in ranks]
            for local, c in enumerate((pod.get("spec") or {}).get("containers") or []):
                rank = ob._rank_of(c["name"])
                if rank is not None and rank not in seen and ranks:
                    ranks.append(RankStatus(rank=rank, local_rank=local, state="exited", exit_code=SIGKILL_EXIT))
            if not ranks and stop_cause is None and error is None:
                stop_cause = "not_launched" if rt.stop_sent_at is not None else None
                if stop_cause is None:
                    error = "the pod was deleted before it ran"
            if stop_cause is None and not finished and error is None:
                stopped_reason = "the pod was deleted outside the platform"
            finished = True
            finished_at = finished_at or self.clock()
        elif self.cfg.follow_logs:
            unread = self._log_unread(pod, rt)
            if unread:
                # a rank is over only once its log (and the SDK events in it: checkpoint,
                # suspend_ready) has been read to the end and shipped, as on agents
                ranks = [RankStatus(rank=r.rank, local_rank=r.local_rank, state="running")
                         if r.state == "exited" and r.rank in unread else r for r in ranks]
                finished = False
        return AttemptStatus(
            job_id=rt.job_id, attempt=rt.attempt, ranks=ranks, launch_error=error,
            suspend_ready=rt.ready_at is not None, stopped_reason=stopped_reason, checkpoint=rt.checkpoint,
            progress=rt.progress, finished=finished, stop_cause=stop_cause, started_at=started,
            finished_at=finished_at if finished else None, suspend_requested_at=rt.suspend_requested_at,
        )

    def _log_unread(self, pod: dict, rt: PodRuntime) -> set[int]:
        """Ranks whose container has ended but whose log has not been read to its end yet; a log
        the API cannot give (LOG_DRAIN_S after the container ended) is not waited for."""
        now = self.clock()
        unread = set()
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            name = cs.get("name") or ""
            ended = (cs.get("state") or {}).get("terminated")
            rank = ob._rank_of(name)
            if rank is None or ended is None or name in rt.drained:
                continue
            at = ob._ts((ended or {}).get("finishedAt"))
            if at is None or now - at < LOG_DRAIN_S:
                unread.add(rank)
        return unread

    def _pods_by_node(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for pod in self.pods.snapshot():
            node = (pod.get("spec") or {}).get("nodeName")
            if node and ob.key_of(pod) is not None:
                out.setdefault(node, []).append(pod)
        return out

    def statuses(self, node: str, pods: list[dict]) -> list[AttemptStatus]:
        out: dict[tuple[int, int], AttemptStatus] = {}
        for pod in pods:
            rt = self._rt(pod)
            if rt is not None:
                out[(rt.job_id, rt.attempt)] = self._pod_status(pod, rt)
        with self.lock:
            for (n, job, attempt), st in self.tombstones.items():
                if n == node and (job, attempt) not in out:
                    out[(job, attempt)] = st
            # created, not yet seen by the informer: pending
            for rt in self.runtime.values():
                if rt.node == node and rt.created and (rt.job_id, rt.attempt) not in out:
                    out[(rt.job_id, rt.attempt)] = AttemptStatus(job_id=rt.job_id, attempt=rt.attempt)
        return [out[k] for k in sorted(out)]

    # ------------------------------------------------------------------ the reconcile loop
    def _reconcile_loop(self) -> None:
        for inf in (self.nodes, self.pods, self.configmaps):
            while not inf.synced.wait(0.5):
                if self.stop_event.is_set():
                    return
        while not self.stop_event.is_set():
            self.wake.clear()
            try:
                self.reconcile_once()
            except Exception:
                log.exception("kubernetes reconcile pass failed; retrying")
                self.stop_event.wait(1.0)
            self.wake.wait(self.cfg.reconcile_interval_s)

    def reconcile_once(self) -> None:
        """One level-triggered pass. A node gets a heartbeat when something may have changed for
        it: its pods or Node changed (watch events), its assignments' fingerprint changed, it has
        attempt reports to hand in, or its keepalive is due. Deadlines (suspend grace, ...) are
        checked for every node with pods, from its last reply, without the database."""
        now = self.clock()
        t_pass = time.perf_counter()
        nodes = {n["metadata"]["name"]: n for n in self.nodes.snapshot()}
        pods_by_node = self._pods_by_node()
        prints = plat.assignment_fingerprints(self.platform)
        with self.lock:
            dirty, self.dirty = self.dirty, set()
            tomb_nodes = {k[0] for k in self.tombstones}
        todo = []
        idle = []
        empty = plat.fingerprint(())
        for name, node in sorted(nodes.items()):
            fp = prints.get(name, empty)
            keepalive = now - self.last_hb.get(name, 0.0) >= self.keepalive_s
            due = fp != self.fingerprints.get(name, empty) or name not in self.registered
            if keepalive and not due:
                quiet = (fp == empty and name not in pods_by_node and name not in tomb_nodes and name not in dirty
                         and not self.sent.get(name))
                if quiet:
                    idle.append(name)  # nothing to say: a bulk liveness update instead of a heartbeat
                else:
                    due = True
            if not due and name in dirty:  # the Node object changed: its inventory or its condition?
                due = (self.registered.get(name) != self._hello(node)
                       or self.node_state_seen.get(name) != ob.node_condition(node))
            if not due and (name in dirty or name in tomb_nodes):
                # something changed on the node: report it if the report changed
                due = self._report(name, pods_by_node.get(name, [])) != self.sent.get(name)
            if due:
                todo.append((name, node, fp))
        if idle:
            plat.touch_idle_nodes(self.platform, idle)
            t = self.clock()
            for name in idle:
                self.last_hb[name] = t
        self._timed("pass_prepare", t_pass)
        t_nodes = time.perf_counter()
        items = [(name, node, pods_by_node.get(name, [])) for name, node, _ in todo]
        # the nodes' heartbeats in batches, one transaction each (issue 14: per node, the
        # transaction's own statements and commit were most of a heartbeat's cost); as many
        # batches as workers, so that the replies' API calls still run side by side
        size = max(1, min(HEARTBEAT_BATCH, -(-len(items) // max(1, self.cfg.heartbeat_workers))))
        futures = [self.pool.submit(self._nodes_pass, items[i:i + size]) for i in range(0, len(items), size)]
        for f in futures:
            try:
                f.result()
            except Exception:
                log.exception("kubernetes node pass failed")
        self._timed("node_passes", t_nodes)
        passed = {name for name, _, _ in todo}
        for name, pods in pods_by_node.items():
            reply = self.replies.get(name)
            if name not in passed and reply is not None:
                try:
                    self._supervise(name, reply, pods)
                except Exception:
                    log.exception("kubernetes supervision of %s failed", name)
        self._gang_check(now)
        self._collect_parents()
        self.passes += 1

    def _hello(self, node: dict) -> AgentHello:
        return ob.node_hello(node, zone_label=self.cfg.zone_label, leaf_label=self.cfg.leaf_label,
                             gpu_resource=self.cfg.gpu_resource)

    def _report(self, name: str, pods: list[dict]) -> list:
        return [st.model_dump(mode="json") for st in self.statuses(name, pods)]

    def _timed(self, what: str, t0: float) -> None:
        self.timings[what] = self.timings.get(what, 0.0) + time.perf_counter() - t0

    def _nodes_pass(self, items: list[tuple[str, dict, list[dict]]]) -> None:
        """Register (a new or changed inventory) or heartbeat each of these nodes, the heartbeats
        in one batch, then apply each node's reply."""
        beats: list[tuple[str, dict, list[dict], AgentHello, Heartbeat]] = []
        for name, node, pods in items:
            try:
                hello = self._hello(node)
                reply = self._register_if_changed(name, node, pods, hello)
                if reply is not None:
                    self._after_reply(name, node, pods, hello, reply)
                    continue
                attempts = self.statuses(name, pods)
                self.sent[name] = [st.model_dump(mode="json") for st in attempts]
                beats.append((name, node, pods, hello,
                              Heartbeat(node=name, attempts=attempts, assignments_digest=self.applied_digest.get(name))))
            except Exception:
                log.exception("kubernetes node pass of %s failed", name)
        if not beats:
            return
        replies = self._heartbeats([b[4] for b in beats])
        for (name, node, pods, hello, _), reply in zip(beats, replies):
            if reply is None:
                continue
            try:
                if reply.reregister:
                    self.registered.pop(name, None)
                    reply = plat.register(self.platform, hello.model_copy(update={"attempts": self.statuses(name, pods)}))
                    self.registered[name] = hello
                self._after_reply(name, node, pods, hello, reply)
            except Exception:
                log.exception("kubernetes node pass of %s failed", name)

    def _register_if_changed(self, name: str, node: dict, pods: list[dict], hello: AgentHello) -> ServerReply | None:
        """Register a node the server has not seen with this inventory (its reply: the
        assignments), and mirror the Node's condition onto the platform node."""
        reply: ServerReply | None = None
        if self.registered.get(name) != hello:
            attempts = self.statuses(name, pods)
            self.sent[name] = [st.model_dump(mode="json") for st in attempts]
            hello_now = hello.model_copy(update={"attempts": attempts})
            reply = plat.register(self.platform, hello_now)
            self.registered[name] = hello
        state = ob.node_condition(node)
        if self.node_state_seen.get(name) != state:
            plat.sync_node_state(self.platform, name, *state)
            self.node_state_seen[name] = state
        return reply

    def _heartbeats(self, hbs: list[Heartbeat]) -> list[ServerReply | None]:
        """One transaction for them all; if it fails (a deadlock the database broke, a node's
        report that raises), each on its own, so one node cannot hold the others back. None:
        that node's heartbeat failed (its next pass sends it again)."""
        t0 = time.perf_counter()
        try:
            replies: list[ServerReply | None] = list(plat.heartbeats(self.platform, hbs))
        except Exception:
            if len(hbs) > 1:
                log.warning("a batch of %d heartbeats failed; sending them one by one", len(hbs), exc_info=True)
            replies = []
            for hb in hbs:
                try:
                    replies.append(plat.heartbeat(self.platform, hb))
                except Exception:
                    log.exception("kubernetes heartbeat of %s failed", hb.node)
                    replies.append(None)
        self._timed("heartbeat", t0)
        self.heartbeats += len(hbs)
        return replies

    def _after_reply(self, name: str, node: dict, pods: list[dict], hello: AgentHello, reply: ServerReply) -> None:
        self.last_hb[name] = self.clock()
        self.fingerprints[name] = plat.reply_fingerprint(reply)
        self.replies[name] = reply
        t0 = time.perf_counter()
        self._apply(name, reply, pods)
        self._timed("apply", t0)
        self.applied_digest[name] = reply.assignments_digest
        self._supervise(name, reply, pods)

    # ------------------------------------------------------------------ applying assignments
    def _apply(self, node: str, reply: ServerReply, pods: list[dict]) -> None:
        wanted = {(a.job_id, a.attempt): a for a in reply.assignments}
        here = {ob.key_of(p): p for p in pods}
        for key, a in sorted(wanted.items()):
            pod = here.get(key)
            pname = ob.pod_name(a.job_id, a.attempt, a.spec.node_rank)
            with self.lock:
                rt = self.runtime.get(pname)
                tomb = self.tombstones.get((node, *key))
            if pod is None:
                if tomb is not None or (rt is not None and rt.created):
                    continue  # gone (reported final) or created and not seen yet
                if a.action == "run":
                    self._create(node, a)
                else:
                    self._not_launched(node, a)
                continue
            rt = self._rt(pod)
            if rt is None or ob.pod_finished(pod) or rt.stop_cause is not None:
                continue
            if a.action == "stop":
                self._stop_pod(pod, rt, "requested", "stop requested by the server")
            elif a.action == "suspend":
                if rt.suspend_requested_at is None:
                    self._request_suspend(pod, rt, a)
            elif a.action == "run" and rt.suspend_requested_at is not None and rt.ready_at is None:
                self._cancel_suspend(pod, rt)
        for key, pod in here.items():
            if key in wanted:
                continue
            rt = self._rt(pod)
            if rt is None or (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue
            if ob.pod_finished(pod):
                self._delete_pod(pod, grace=0)  # finished and released: clean up
            elif rt.stop_cause is None:
                self._stop_pod(pod, rt, "unassigned", "the server no longer assigns this attempt")
        with self.lock:
            for k in [k for k in self.tombstones if k[0] == node and (k[1], k[2]) not in wanted]:
                del self.tombstones[k]
            for pname, rt in list(self.runtime.items()):
                if rt.node == node and (rt.job_id, rt.attempt) not in wanted and (rt.job_id, rt.attempt) not in here:
                    del self.runtime[pname]

    def _not_launched(self, node: str, a: Assignment) -> None:
        st = AttemptStatus(job_id=a.job_id, attempt=a.attempt, finished=True, stop_cause="not_launched",
                           stopped_reason=f"{a.action} arrived before this node launched the attempt",
                           finished_at=self.clock())
        with self.lock:
            self.tombstones[(node, a.job_id, a.attempt)] = st
        self._mark(node)

    def _parent(self, a: Assignment) -> dict:
        key = (a.job_id, a.attempt)
        with self.lock:
            parent = self.parents.get(key)
        if parent is not None and parent["metadata"].get("uid"):
            return parent
        body = ob.parent_configmap(a, namespace=self.ns, now=self.clock())
        try:
            parent = _json(self.api.create_namespaced_config_map(self.ns, body, _preload_content=False))
        except ApiException as e:
            if e.status != 409:
                raise
            parent = _json(self.api.read_namespaced_config_map(body["metadata"]["name"], self.ns, _preload_content=False))
        with self.lock:
            self.parents[key] = parent
        return parent

    def _create(self, node: str, a: Assignment) -> None:
        """Idempotent: the parent, the Service and this node's pod; 409 = exists. Every node's
        pass ensures the Service before its pod, so MASTER_ADDR resolves for every rank."""
        parent = self._parent(a)
        if a.spec.nnodes > 1:  # one node: every rank is in this pod
            try:
                self.api.create_namespaced_service(self.ns, ob.master_service(a, namespace=self.ns, parent=parent),
                                                   _preload_content=False)
            except ApiException as e:
                if e.status != 409:
                    raise
        pod = ob.attempt_pod(
            a, node=node, namespace=self.ns, parent=parent, image=self.cfg.image, python=self.cfg.python,
            gpu_resource=self.cfg.gpu_resource, image_pull_policy=self.cfg.image_pull_policy,
            service_account=self.cfg.service_account, checkpoint_claim=self.cfg.checkpoint_claim,
            checkpoint_host_path=self.cfg.checkpoint_host_path, checkpoint_mount=self.cfg.checkpoint_mount,
            stop_grace_s=a.spec.stop_grace_s if a.spec.stop_grace_s is not None else 10.0,
            rdma_resource=self.cfg.rdma_resource,
        )
        if a.action == "suspend":
            pod["metadata"]["annotations"][ob.SUSPEND_ANNOTATION] = ob.suspend_value(self.clock(), a.spec.suspend_grace_s)
        pname = pod["metadata"]["name"]
        with self.lock:
            self.runtime[pname] = PodRuntime(job_id=a.job_id, attempt=a.attempt, node=node, created=True)
        try:
            self.api.create_namespaced_pod(self.ns, pod, _preload_content=False)
            self.pods_created += 1
            log.info("job %s attempt %s: pod %s on node %s", a.job_id, a.attempt, pname, node)
        except ApiException as e:
            if e.status != 409:
                with self.lock:
                    self.runtime.pop(pname, None)
                raise

    def _patch_pod(self, pod: dict, annotations: dict[str, str | None]) -> None:
        try:
            self.api.patch_namespaced_pod(pod["metadata"]["name"], self.ns, {"metadata": {"annotations": annotations}},
                                          _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    def _request_suspend(self, pod: dict, rt: PodRuntime, a: Assignment) -> None:
        at = self.clock()
        self._patch_pod(pod, {ob.SUSPEND_ANNOTATION: ob.suspend_value(at, a.spec.suspend_grace_s)})
        rt.suspend_requested_at = at
        log.info("job %s attempt %s: suspend requested on %s (grace %ss)", rt.job_id, rt.attempt, rt.node,
                 a.spec.suspend_grace_s)

    def _cancel_suspend(self, pod: dict, rt: PodRuntime) -> None:
        self._patch_pod(pod, {ob.SUSPEND_ANNOTATION: None})
        rt.suspend_requested_at = None
        rt.rank_ready.clear()

    def _delete_pod(self, pod: dict, *, grace: int) -> None:
        try:
            self.api.delete_namespaced_pod(pod["metadata"]["name"], self.ns, grace_period_seconds=grace,
                                           _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    def _stop_pod(self, pod: dict, rt: PodRuntime, cause: str, reason: str, grace: float | None = None) -> None:
        """Record why (on the pod, so a restarted backend knows), then delete it: the kubelet sends
        SIGTERM and SIGKILL after the grace period."""
        if rt.stop_cause is not None:
            return
        at = self.clock()
        rt.stop_cause, rt.stopped_reason, rt.stop_sent_at = cause, reason, at
        self._patch_pod(pod, {ob.STOP_ANNOTATION: json.dumps({"cause": cause, "reason": reason, "at": at})})
        if grace is None:
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
            grace = 10 if grace is None else grace
        self._delete_pod(pod, grace=int(grace))
        log.info("job %s attempt %s: stopping pod %s (%s)", rt.job_id, rt.attempt, pod["metadata"]["name"], reason)

    def _supervise(self, node: str, reply: ServerReply, pods: list[dict]) -> None:
        """The agent's deadlines, for pods: suspend_ready exit window, suspend grace, a failed rank,
        max runtime, the log watchdog."""
        now = self.clock()
        specs = {(a.job_id, a.attempt): a.spec for a in reply.assignments}
        for pod in pods:
            rt = self._rt(pod)
            key = ob.key_of(pod)
            spec = specs.get(key) if key else None
            if rt is None or spec is None or rt.stop_cause is not None or ob.pod_finished(pod):
                continue
            ranks, _, started, _ = ob.pod_ranks(pod)
            failed = [r for r in ranks if r.state == "exited" and r.exit_code not in (0, None)]
            grace = spec.stop_grace_s if spec.stop_grace_s is not None else 10.0
            if failed:
                self._stop_pod(pod, rt, "rank_failed", f"rank {failed[0].rank} exited with code {failed[0].exit_code}")
            elif rt.ready_at is not None:
                if now - rt.ready_at >= min(READY_EXIT_WINDOW_S, grace):
                    self._stop_pod(pod, rt, "suspend", "stopped after the job called suspend_ready()")
            elif rt.suspend_requested_at is not None:
                if now - rt.suspend_requested_at >= spec.suspend_grace_s:
                    self._stop_pod(pod, rt, "suspend_timeout",
                                   f"the job did not call suspend_ready() within suspend_grace_s={spec.suspend_grace_s:g}s")
            elif started is not None and spec.max_runtime_s is not None and now - started >= spec.max_runtime_s:
                self._stop_pod(pod, rt, "max_runtime", f"max_runtime_s={spec.max_runtime_s:g}s exceeded")
            elif started is not None and spec.log_watchdog_s is not None and self.cfg.follow_logs:
                last = max(started, rt.last_output_at or 0.0)
                if now - last >= spec.log_watchdog_s:
                    self._stop_pod(pod, rt, "log_watchdog", f"no output for log_watchdog_s={spec.log_watchdog_s:g}s")

    # ------------------------------------------------------------------ gang, garbage
    def _gang_check(self, now: float) -> None:
        by_key: dict[tuple[int, int], list[dict]] = {}
        for pod in self.pods.snapshot():
            key = ob.key_of(pod)
            if key is not None:
                by_key.setdefault(key, []).append(pod)
        with self.lock:
            parents = dict(self.parents)
        for key, parent in parents.items():
            if key in self.gang_ok or key in self.gang_requeued:
                continue
            ann = parent["metadata"].get("annotations") or {}
            try:
                created = float(ann[ob.CREATED_ANNOTATION])
                nnodes = int(ann["hai.io/nnodes"])
            except (KeyError, ValueError):
                continue
            pods = by_key.get(key, [])
            started = [p for p in pods if ob.pod_all_started(p) or ob.pod_finished(p)]
            if len(started) >= nnodes:
                self.gang_ok.add(key)
                continue
            if now - created < self.cfg.gang_timeout_s:
                continue
            reason = (f"gang timeout: {len(started)} of {nnodes} pods running after "
                      f"{self.cfg.gang_timeout_s:g}s; torn down and requeued (not started)")
            log.warning("job %s attempt %s: %s", key[0], key[1], reason)
            self.gang_requeued.add(key)
            plat.requeue_not_started(self.platform, key[0], key[1], reason)
            for pod in pods:
                rt = self._rt(pod)
                if rt is not None and rt.stop_cause is None:
                    self._stop_pod(pod, rt, "gang_timeout", reason, grace=0)
            self._delete_parent(parent)

    def _delete_parent(self, parent: dict) -> None:
        try:
            self.api.delete_namespaced_config_map(parent["metadata"]["name"], self.ns, propagation_policy="Background",
                                                  _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    def _collect_parents(self) -> None:
        """Parents of attempts no node is assigned and with no pod left: delete (cascades)."""
        wanted = {(a.job_id, a.attempt) for r in list(self.replies.values()) for a in r.assignments}
        with self.lock:
            wanted |= {(rt.job_id, rt.attempt) for rt in self.runtime.values()}
        with_pods = {ob.key_of(p) for p in self.pods.snapshot()}
        for parent in self.configmaps.snapshot():
            key = ob.key_of(parent)
            if key is None or key in wanted or key in with_pods:
                continue
            if (parent["metadata"] or {}).get("deletionTimestamp"):
                continue
            self._delete_parent(parent)
            with self.lock:
                self.parents.pop(key, None)

    # ------------------------------------------------------------------ node drain -> cordon
    def cordon(self, node_name: str, reason: str) -> None:
        """Cordon the Kubernetes Node (spec.unschedulable) with the platform's reason; idempotent."""
        self.api.patch_node(node_name, {"spec": {"unschedulable": True},
                                        "metadata": {"annotations": {ob.CORDON_ANNOTATION: reason}}},
                            _preload_content=False)

    def uncordon(self, node_name: str) -> None:
        self.api.patch_node(node_name, {"spec": {"unschedulable": False},
                                        "metadata": {"annotations": {ob.CORDON_ANNOTATION: None}}},
                            _preload_content=False)

    # ------------------------------------------------------------------ logs and SDK events
    def _follow(self, pod: dict, rt: PodRuntime) -> None:
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        for cs in statuses:
            state = cs.get("state") or {}
            name = cs.get("name") or ""
            rank = ob._rank_of(name)
            if rank is None or not ("running" in state or "terminated" in state):
                continue
            with self.lock:
                if name in rt.followed:
                    continue
                rt.followed.add(name)
            t = threading.Thread(target=self._follow_container, args=(pod["metadata"]["name"], name, rank, rt),
                                 name=f"hai-k8s-log-{pod['metadata']['name']}-{name}", daemon=True)
            t.start()

    def _follow_container(self, pod: str, container: str, rank: int, rt: PodRuntime) -> None:
        """Follow one container's log from its start (a re-sent line keeps its seq: stored once);
        once it has ended, the log loop ships what was read and then lets the node report the
        rank as over (issue 14: the containers that end together share one transaction, not one
        each)."""
        try:
            self._read_container_log(pod, container, rank, rt)
        finally:
            with self.log_lock:
                self.log_drains.append((rt, container))
            self.log_wake.set()

    def _read_container_log(self, pod: str, container: str, rank: int, rt: PodRuntime) -> None:
        while not self.stop_event.is_set():
            seq = 0
            try:
                resp = self.api.read_namespaced_pod_log(pod, self.ns, container=container, follow=True,
                                                        _preload_content=False)
                pending = b""
                for chunk in resp.stream(65536, decode_content=True):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        seq = self._log_line(rt, rank, seq, raw)
                    if self.stop_event.is_set():
                        break
                if pending:
                    seq = self._log_line(rt, rank, seq, pending)
                resp.release_conn()
                return  # the stream ends when the container has ended
            except ApiException as e:
                if e.status in (404, 400):
                    return
            except Exception as e:
                log.debug("log of %s/%s: %s", pod, container, e)
            self.stop_event.wait(1.0)

    def _log_line(self, rt: PodRuntime, rank: int, seq: int, raw: bytes) -> int:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        now = self.clock()
        if line.startswith(EVENT_PREFIX):
            try:
                self._event(rt, rank, json.loads(line[len(EVENT_PREFIX):]))
            except ValueError:
                pass
            return seq
        rt.last_output_at = now
        with self.log_lock:
            self.log_buf.append(LogLine(job_id=rt.job_id, attempt=rt.attempt, rank=rank, seq=seq, ts=now, line=line))
        return seq + 1

    def _event(self, rt: PodRuntime, rank: int, ev: dict) -> None:
        kind = ev.get("type")
        at = float(ev.get("at") or self.clock())
        try:
            if kind == "checkpoint":
                ck = CheckpointInfo(path=str(ev["path"]), step=ev.get("step"), at=at, duration_s=ev.get("duration_s"))
                if rt.checkpoint is None or ck.at >= rt.checkpoint.at:
                    rt.checkpoint = ck
            elif kind == "progress":
                pr = ProgressInfo(step=int(ev["step"]), total=ev.get("total"), at=at,
                                  metrics={k: float(v) for k, v in (ev.get("metrics") or {}).items()
                                           if isinstance(v, (int, float))})
                if rt.progress is None or pr.at >= rt.progress.at:
                    rt.progress = pr
                return
            elif kind == "suspend_ready":
                rt.rank_ready.setdefault(int(ev.get("rank", rank)), at)
                req = rt.suspend_requested_at
                if rt.ready_at is None and req is not None and at >= req - 1.0:
                    rt.ready_at = self.clock()
                    log.info("job %s attempt %s: suspend_ready() on %s", rt.job_id, rt.attempt, rt.node)
        except (KeyError, ValueError, TypeError):
            return
        self._mark(rt.node)

    def _log_loop(self) -> None:
        """Ship the lines read every 0.25 s, and at once when a container's log has ended."""
        while not self.stop_event.is_set():
            self.log_wake.wait(0.25)
            self.log_wake.clear()
            if self.stop_event.is_set():
                break
            try:
                self._flush_logs()
            except Exception:
                log.exception("shipping pod logs failed; retrying")
                self.stop_event.wait(0.25)

    def _flush_logs(self) -> None:
        """Ship the lines read so far; then the containers whose log had ended before are
        drained (their ranks may be reported over)."""
        with self.log_lock:
            lines, self.log_buf = self.log_buf, []
            drains, self.log_drains = self.log_drains, []
        for i in range(0, len(lines), 2000):
            try:
                plat.append_logs(self.platform, LogBatch(node="kubernetes", lines=lines[i:i + 2000]))
            except Exception:
                with self.log_lock:
                    self.log_buf[:0] = lines[i:]
                    self.log_drains[:0] = drains
                raise
        for rt, container in drains:
            rt.drained.add(container)
        for node in {rt.node for rt, _ in drains}:
            self._mark(node)


_current: KubernetesBackend | None = None


def _api_for_calls() -> k8s.CoreV1Api:
    if _current is not None:
        return _current.api
    from hai.settings import get_settings

    return make_api(get_settings().kubernetes, pool=2)


def cordon(node_name: str, reason: str) -> None:
    """Drain in the platform -> cordon in Kubernetes (``spec.unschedulable`` and the reason as the
    annotation ``hai.io/cordon-reason``). Call it from the node-drain service when
    HAI_EXECUTOR=kubernetes, after the drain is committed; idempotent. Uses this process's
    backend when it runs one, else a client built from the settings (needs nodes/patch)."""
    _api_for_calls().patch_node(node_name, {"spec": {"unschedulable": True},
                                            "metadata": {"annotations": {ob.CORDON_ANNOTATION: reason}}},
                                _preload_content=False)


def uncordon(node_name: str) -> None:
    """The platform's un-drain -> uncordon in Kubernetes."""
    _api_for_calls().patch_node(node_name, {"spec": {"unschedulable": False},
                                            "metadata": {"annotations": {ob.CORDON_ANNOTATION: None}}},
                                _preload_content=False)


def node_health(node_name: str) -> tuple[bool, str]:
    """(healthy, why) of a Kubernetes Node apart from its cordon: what an undrain without force
    checks in Kubernetes mode, where the kubelet and the device plugin watch the hardware and the
    platform runs no validators. A Node that does not exist is not healthy."""
    try:
        node = _json(_api_for_calls().read_node(node_name, _preload_content=False))
    except ApiException as e:
        if e.status == 404:
            return False, f"Kubernetes has no Node {node_name}"
        raise
    node = {**node, "spec": {**(node.get("spec") or {}), "unschedulable": False}}
    state, why = ob.node_condition(node)
    return state == "ready", why or "the Kubernetes Node is Ready"


def start_backend(platform: Platform, api: k8s.CoreV1Api | None = None) -> KubernetesBackend:
    global _current
    backend = KubernetesBackend(platform, api)
    backend.start()
    _current = backend
    return backend
