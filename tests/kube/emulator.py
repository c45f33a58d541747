"""A Kubernetes API for tests: kmock's KubernetesEmulator (HTTP server, request parsing, the
object store with its history) plus the gaps the platform's backend relies on, filled here:

- resourceVersion: one cluster-wide counter stamped on every write; lists carry it; a watch
  from resourceVersion N replays the changes after N, a compacted one answers 410 Gone;
  ``timeoutSeconds`` ends a watch (the client resumes it); bookmarks are not sent;
- label selectors (=, ==, !=, exists, !exists, in, notin) and field selectors (metadata.name,
  metadata.namespace, spec.nodeName, status.phase) on lists and watches;
- uid, creationTimestamp, generation on create; 409 AlreadyExists, 404 NotFound as Status;
- graceful pod deletion (deletionTimestamp + deletionGracePeriodSeconds; the kubelet finishes
  it with grace 0; unscheduled or terminal pods go at once) and the garbage collector's
  cascade over ownerReferences (background propagation; Orphan keeps dependents);
- the pods/log subresource (follow), served from the files the fake kubelet writes.

Merge patches only (the backend sends JSON merge patches); lists are replaced, not merged.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock


KINDS = {
    "pods": "Pod", "nodes": "Node", "configmaps": "ConfigMap", "services": "Service", "secrets": "Secret",
    "namespaces": "Namespace", "serviceaccounts": "ServiceAccount", "deployments": "Deployment", "jobs": "Job",
    "daemonsets": "DaemonSet", "statefulsets": "StatefulSet", "roles": "Role", "rolebindings": "RoleBinding",
    "clusterroles": "ClusterRole", "clusterrolebindings": "ClusterRoleBinding",
    "persistentvolumeclaims": "PersistentVolumeClaim", "poddisruptionbudgets": "PodDisruptionBudget",
    "leases": "Lease", "events": "Event",
}
CLUSTER_SCOPED = {"nodes", "namespaces", "clusterroles", "clusterrolebindings"}
HISTORY_MAX = 200_000


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_label_selector(sel: str) -> list[tuple[str, str, set[str]]]:
    """[(key, op, values)] with op in =, !=, exists, !exists, in, notin."""
    out = []
    parts, depth, cur = [], 0, ""
    for ch in sel:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur:
        parts.append(cur)
    for raw in parts:
        p = raw.strip()
        if not p:
            continue
        for word, op in ((" notin ", "notin"), (" in ", "in")):
            if word in p:
                k, vals = p.split(word, 1)
                out.append((k.strip(), op, {v.strip() for v in vals.strip().strip("()").split(",")}))
                break
        else:
            if "!=" in p:
                k, v = p.split("!=", 1)
                out.append((k.strip(), "!=", {v.strip()}))
            elif "==" in p or "=" in p:
                k, v = p.split("==", 1) if "==" in p else p.split("=", 1)
                out.append((k.strip(), "=", {v.strip()}))
            elif p.startswith("!"):
                out.append((p[1:].strip(), "!exists", set()))
            else:
                out.append((p, "exists", set()))
    return out


def labels_match(labels: dict, reqs: list[tuple[str, str, set[str]]]) -> bool:
    for k, op, vals in reqs:
        v = labels.get(k)
        if op == "=" and v not in vals:
            return False
        if op == "!=" and v in vals:
            return False
        if op == "exists" and k not in labels:
            return False
        if op == "!exists" and k in labels:
            return False
        if op == "in" and v not in vals:
            return False
        if op == "notin" and v in vals:
            return False
    return True


def _field(obj: dict, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def fields_match(obj: dict, sel: str) -> bool:
    for p in [s.strip() for s in sel.split(",") if s.strip()]:
        if "!=" in p:
            k, v = p.split("!=", 1)
            if _field(obj, k.strip()) == v.strip():
                return False
        else:
            k, v = p.split("==", 1) if "==" in p else p.split("=", 1)
            if _field(obj, k.strip()) != v.strip():
                return False
    return True


class LogSource:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = False


class HaiEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the gaps above filled (see the module docstring)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.rv = 0
        self.history: dict[str, list[tuple[int, str, dict]]] = {}
        self.compacted_below: dict[str, int] = {}
        self.watchers: list[tuple[str, asyncio.Queue]] = []
        self.logs: dict[tuple[str, str, str], LogSource] = {}
        self.writes = 0
        self.dependents: dict[str, set] = {}  # owner uid -> keys of the objects it owns

    # ------------------------------------------------------------------ helpers
    def _status(self, code: int, reason: str, message: str) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                          "code": code, "reason": reason, "message": message}, status=code)

    def _publish(self, plural: str, typ: str, obj: dict) -> None:
        hist = self.history.setdefault(plural, [])
        snap = json.loads(json.dumps(obj))
        hist.append((self.rv, typ, snap))
        if len(hist) > HISTORY_MAX:
            drop = len(hist) - HISTORY_MAX
            self.compacted_below[plural] = hist[drop][0]
            del hist[:drop]
        for p, q in list(self.watchers):
            if p == plural:
                q.put_nowait((self.rv, typ, snap))

    def compact(self) -> None:
        """Forget the change history (as etcd compaction does): old resourceVersions get 410."""
        for plural, hist in self.history.items():
            self.compacted_below[plural] = self.rv + 1
            hist.clear()

    def _bump(self, meta: dict) -> int:
        self.rv += 1
        self.writes += 1
        meta["resourceVersion"] = str(self.rv)
        return self.rv

    def _ns(self, request: kmock.Request, plural: str) -> str | None:
        return None if plural in CLUSTER_SCOPED else request.namespace

    def _matching(self, request: kmock.Request, plural: str) -> list[dict]:
        ns = self._ns(request, plural)
        labels = parse_label_selector(request.params.get("labelSelector", ""))
        fields = request.params.get("fieldSelector", "")
        out = []
        for (res, ons, _name), obj in self._objects.items():
            if res.plural != plural or obj.deleted or (ns is not None and ons != ns):
                continue
            raw = obj.raw
            if labels and not labels_match((raw.get("metadata") or {}).get("labels") or {}, labels):
                continue
            if fields and not fields_match(raw, fields):
                continue
            out.append(raw)
        return out

    def _event_matches(self, request: kmock.Request, plural: str, obj: dict) -> bool:
        ns = self._ns(request, plural)
        meta = obj.get("metadata") or {}
        if ns is not None and meta.get("namespace") != ns:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        labels = parse_label_selector(request.params.get("labelSelector", ""))
        if labels and not labels_match(meta.get("labels") or {}, labels):
            return False
        fields = request.params.get("fieldSelector", "")
        return not fields or fields_match(obj, fields)

    # ------------------------------------------------------------------ dispatch
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's path parser takes /api/v1/namespaces[/name] for a namespace prefix and fails
        m = re.fullmatch(r"/api/v1/namespaces(?:/([^/]+))?", raw_request.path)
        if m is None:
            return await super().__call__(raw_request)
        body = await raw_request.read()
        data = json.loads(body) if body else None
        method = raw_request.method.upper()
        name = m.group(1)
        action = ({"GET": kmock.action.FETCH, "PATCH": kmock.action.UPDATE, "DELETE": kmock.action.DELETE}.get(method)
                  if name else {"GET": kmock.action.LIST, "POST": kmock.action.CREATE}.get(method))
        request = kmock.Request(raw_request=raw_request, method=method, url=raw_request.url,
                                params=dict(raw_request.query), data=data, body=body, action=action,
                                resource=kmock.resource(group="", version="v1", plural="namespaces"), name=name)
        return await self._handle(request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None:
            return await super()._handle(request)
        plural = res.plural
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        if request.subresource == "log" and plural == "pods":
            return await self._serve_log(request)
        # the official client sends watch=True (kmock only recognises watch=true)
        if method == "GET" and str(request.params.get("watch", "")).lower() in ("true", "1"):
            return await self._watch(request, plural)
        if request.action == kmock.action.LIST:
            kind = KINDS.get(plural, plural.capitalize())
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": f"{kind}List",
                                              "metadata": {"resourceVersion": str(self.rv)},
                                              "items": self._matching(request, plural)})
        if request.action == kmock.action.CREATE:
            return self._create(request, res, plural)
        if request.name is None:
            return await super()._handle(request)
        key = (res, self._ns(request, plural), request.name)
        obj = self._objects[key] if key in self._objects else None
        if obj is None or obj.deleted:
            return self._status(404, "NotFound", f'{plural} "{request.name}" not found')
        if request.action == kmock.action.FETCH:
            return aiohttp.web.json_response(obj.raw)
        if request.action == kmock.action.UPDATE or method == "PUT":
            return self._update(request, key, obj, plural, replace=method == "PUT")
        if request.action == kmock.action.DELETE:
            return self._delete_request(request, key, obj, plural)
        return await super()._handle(request)

    # ------------------------------------------------------------------ writes
    def _create(self, request: kmock.Request, res, plural: str) -> aiohttp.web.Response:
        data = request.data
        if not isinstance(data, dict):
            return self._status(400, "BadRequest", "the body must be a JSON object")
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            return self._status(422, "Invalid", "metadata.name: Required value")
        ns = self._ns(request, plural) or (None if plural in CLUSTER_SCOPED else meta.get("namespace"))
        key = (res, ns, meta["name"])
        if key in self._objects and not self._objects[key].deleted:
            return self._status(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists')
        if ns is not None:
            meta["namespace"] = ns
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        data.setdefault("kind", KINDS.get(plural, plural.capitalize()))
        if plural == "pods":
            data.setdefault("status", {}).setdefault("phase", "Pending")
        self._bump(meta)
        if key in self._objects:
            self._objects[key].create(data)
        else:
            self._objects[key] = data
        raw = self._objects[key].raw
        for ref in meta.get("ownerReferences") or []:
            self.dependents.setdefault(ref.get("uid"), set()).add(key)
        self._publish(plural, "ADDED", raw)
        return aiohttp.web.json_response(raw, status=201)

    def _update(self, request, key, obj, plural: str, *, replace: bool) -> aiohttp.web.Response:
        data = request.data
        if not isinstance(data, dict):
            return self._status(415, "UnsupportedMediaType", "only merge patches (JSON objects) are emulated")
        if replace:
            old = obj.raw.get("metadata") or {}
            meta = data.setdefault("metadata", {})
            for k in ("uid", "creationTimestamp", "namespace", "deletionTimestamp"):
                if k in old:
                    meta[k] = old[k]
            self._bump(meta)
            obj.create(data)
        else:
            data = json.loads(json.dumps(data))
            self._bump(data.setdefault("metadata", {}))
            obj.patch(data)
        raw = obj.raw
        for ref in (raw.get("metadata") or {}).get("ownerReferences") or []:
            self.dependents.setdefault(ref.get("uid"), set()).add(key)
        self._publish(plural, "MODIFIED", raw)
        return aiohttp.web.json_response(raw)

    def _delete_request(self, request, key, obj, plural: str) -> aiohttp.web.Response:
        body = request.data if isinstance(request.data, dict) else {}
        grace = request.params.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        policy = request.params.get("propagationPolicy", body.get("propagationPolicy")) or "Background"
        raw = self.delete(key, plural, grace=None if grace is None else int(grace), policy=policy)
        return aiohttp.web.json_response(raw)

    def delete(self, key, plural: str, *, grace: int | None, policy: str = "Background") -> dict:
        obj = self._objects[key]
        raw = obj.raw
        meta = raw.get("metadata") or {}
        if plural == "pods":
            spec, status = raw.get("spec") or {}, raw.get("status") or {}
            if grace is None:
                grace = int(spec.get("terminationGracePeriodSeconds", 30))
            if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
                grace = 0
            if grace > 0:
                cur = meta.get("deletionGracePeriodSeconds")
                if cur is not None and cur <= grace:
                    return raw  # already terminating, no later than this
                when = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=grace)
                patch = {"metadata": {"deletionTimestamp": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                      "deletionGracePeriodSeconds": grace}}
                self._bump(patch["metadata"])
                obj.patch(patch)
                self._publish(plural, "MODIFIED", obj.raw)
                return obj.raw
        if meta.get("finalizers"):
            patch = {"metadata": {"deletionTimestamp": _now()}}
            self._bump(patch["metadata"])
            obj.patch(patch)
            self._publish(plural, "MODIFIED", obj.raw)
            return obj.raw
        patch = {"metadata": {}}
        self._bump(patch["metadata"])
        obj.patch(patch)
        last = obj.raw
        obj.delete()
        self._publish(plural, "DELETED", last)
        if policy != "Orphan":
            self._collect_dependents(meta.get("uid"))
        return last

    def _collect_dependents(self, uid: str | None) -> None:
        """The garbage collector: dependents of a deleted owner are deleted (background)."""
        if not uid:
            return
        for key in sorted(self.dependents.pop(uid, set()), key=lambda k: (k[0].plural, k[1] or "", k[2])):
            obj = self._objects[key] if key in self._objects else None
            if obj is None or obj.deleted:
                continue
            refs = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):  # still owned (the index is only a hint)
                self.delete(key, key[0].plural, grace=None)

    # ------------------------------------------------------------------ watch
    async def _watch(self, request: kmock.Request, plural: str) -> aiohttp.web.StreamResponse:
        rv_param = request.params.get("resourceVersion") or ""
        timeout = float(request.params.get("timeoutSeconds") or 1800)
        queue: asyncio.Queue = asyncio.Queue()
        initial: list[tuple[str, dict]] = []
        gone = False
        # no await between the snapshot and the registration: nothing is missed or doubled
        if rv_param in ("", "0"):
            for obj in self._matching(request, plural):
                if request.name is None or obj["metadata"]["name"] == request.name:
                    initial.append(("ADDED", obj))
        else:
            since = int(rv_param)
            if since + 1 < self.compacted_below.get(plural, 0):
                gone = True
            else:
                for rv, typ, obj in self.history.get(plural, []):
                    if rv > since and self._event_matches(request, plural, obj):
                        initial.append((typ, obj))
        entry = (plural, queue)
        self.watchers.append(entry)
        resp = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        try:
            await resp.prepare(request._raw_request)
            if gone:
                await resp.write(json.dumps({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
                    "message": f"too old resource version: {rv_param}"}}).encode() + b"\n")
                return resp
            for typ, obj in initial:
                await resp.write(json.dumps({"type": typ, "object": obj}).encode() + b"\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    rv, typ, obj = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if self._event_matches(request, plural, obj):
                    await resp.write(json.dumps({"type": typ, "object": obj}).encode() + b"\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.watchers.remove(entry)
        return resp

    # ------------------------------------------------------------------ logs
    async def _serve_log(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        container = request.params.get("container") or ""
        src = self.logs.get((request.namespace or "", request.name or "", container))
        if src is None:
            return self._status(400, "BadRequest", f'container "{container}" in pod "{request.name}" is waiting to start')
        follow = request.params.get("follow") in ("true", "1", "True")
        if not follow:
            return aiohttp.web.Response(body=src.path.read_bytes() if src.path.exists() else b"",
                                        content_type="text/plain")
        resp = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        try:
            await resp.prepare(request._raw_request)
            off = 0
            idle = 0.02
            while True:
                done = src.done
                try:
                    with open(src.path, "rb") as f:
                        f.seek(off)
                        data = f.read()
                except OSError:
                    data = b""
                if data:
                    off += len(data)
                    idle = 0.02
                    await resp.write(data)
                elif done:
                    break
                else:
                    await asyncio.sleep(idle)
                    idle = min(0.5, idle * 2)  # quiet logs are polled less often
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp


class Cluster:
    """The emulator on a loopback port, in a thread with its own event loop; a kubeconfig for it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="k8s-emulator", daemon=True)
        self.emu: HaiEmulator | None = None
        self.server = None
        self.url = ""
        self.kubeconfig = tmp / "kubeconfig"

    def start(self) -> "Cluster":
        self.thread.start()

        async def enter():
            emu = HaiEmulator()
            await emu.__aenter__()
            server = kmock.Server(emu)
            await server.__aenter__()
            return emu, server

        self.emu, self.server = asyncio.run_coroutine_threadsafe(enter(), self.loop).result(30)
        self.url = str(self.server.url).rstrip("/")
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test", "namespace": "hai-jobs"}}],
            "users": [{"name": "test", "user": {"token": "test"}}],
        }))
        return self

    def call(self, fn, *args, **kw):
        """Run fn in the emulator's loop (it owns the store) and return its result."""
        async def run():
            return fn(*args, **kw)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def set_log(self, ns: str, pod: str, container: str, path: Path) -> LogSource:
        src = LogSource(path)
        self.call(self.emu.logs.__setitem__, (ns, pod, container), src)
        return src

    def stop(self) -> None:
        async def leave():
            await self.server.__aexit__(None, None, None)
            try:
                await self.emu.__aexit__(None, None, None)
            except Exception:
                pass

        try:
            asyncio.run_coroutine_threadsafe(leave(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def api_for(cluster: Cluster, pool: int = 32):
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    return client.ApiClient(cfg)


__all__ = ["Cluster", "HaiEmulator", "api_for", "parse_label_selector", "labels_match", "os"]
