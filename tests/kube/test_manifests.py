"""deploy/kubernetes/: every manifest is a typed object of the official client (no unknown
field, no mistyped value: a round trip through the client's models gives it back unchanged)
and is applied to the emulator through the client's typed APIs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.kube.emulator import Cluster, api_for

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))


def _docs() -> list[dict]:
    out = []
    for path in MANIFESTS:
        out.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return out


def _model_name(doc: dict) -> str:
    group_version = doc["apiVersion"]
    version = group_version.split("/")[-1]
    group = group_version.split("/")[0].split(".")[0] if "/" in group_version else ""
    prefix = {"": "", "apps": "", "batch": "", "rbac": ""}.get(group, group.capitalize())
    return f"V{version[1:]}{prefix}{doc['kind']}"


def _to_model(api: client.ApiClient, doc: dict):
    return api._ApiClient__deserialize(doc, _model_name(doc))  # the client's own deserializer


def _normal(value):
    """YAML and the client's serialisation differ only in quantity/int-or-string spelling."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("k8s")).start()
    yield c
    c.stop()


def test_there_is_a_manifest_for_every_part():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in _docs()}
    assert {("Deployment", "hai-api"), ("Deployment", "hai-scheduler"), ("Deployment", "hai-worker"),
            ("Job", "hai-migrate"), ("ServiceAccount", "hai-backend"), ("DaemonSet", "hai-agent"),
            ("Deployment", "hai-kubernetes-backend"), ("Service", "hai-api")} <= kinds
    replicas = {d["metadata"]["name"]: d["spec"].get("replicas") for d in _docs() if d["kind"] == "Deployment"}
    assert replicas["hai-api"] == 2 and replicas["hai-scheduler"] == 2
    assert replicas["hai-kubernetes-backend"] == 1 and replicas["hai-worker"] == 1  # one reconciler, one beat


@pytest.mark.parametrize("doc", _docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_a_typed_object_of_the_official_client(doc):
    api = client.ApiClient()
    model = _to_model(api, doc)
    assert type(model).__name__ == _model_name(doc)
    back = api.sanitize_for_serialization(model)
    assert _normal(back) == _normal(doc), "a field the client does not know, or a mistyped value"


def test_commands_are_the_platform_commands():
    cmds = {d["metadata"]["name"]: (d["spec"]["template"]["spec"]["containers"][0]["command"])
            for d in _docs() if d["kind"] in ("Deployment", "DaemonSet", "Job")}
    assert cmds["hai-api"][:2] == ["hai", "server"]
    assert cmds["hai-scheduler"] == ["hai", "scheduler"]
    assert cmds["hai-kubernetes-backend"] == ["hai", "kubernetes"]
    assert cmds["hai-worker"][:4] == ["celery", "-A", "hai.tasks", "worker"]
    assert cmds["hai-migrate"] == ["alembic", "upgrade", "head"]
    assert cmds["hai-agent"][:2] == ["hai", "agent"]


def test_rbac_is_the_least_the_backend_needs():
    """Exactly the calls backend.py makes (no wildcard, nothing more)."""
    rules = {}
    for d in _docs():
        if d["kind"] in ("Role", "ClusterRole"):
            for r in d["rules"]:
                assert "*" not in r["verbs"] and "*" not in r["resources"] and r["apiGroups"] == [""]
                for res in r["resources"]:
                    rules[(d["kind"], res)] = set(r["verbs"])
    assert rules == {
        ("ClusterRole", "nodes"): {"list", "watch", "patch"},
        ("Role", "pods"): {"list", "watch", "create", "patch", "delete"},
        ("Role", "pods/log"): {"get"},
        ("Role", "services"): {"create"},
        ("Role", "configmaps"): {"get", "list", "watch", "create", "delete"},
    }
    # and the backend's source makes no other kind of call
    src = (REPO / "backend" / "hai" / "integrations" / "kubernetes" / "backend.py").read_text()
    calls = set(re.findall(r"\.api\.([a-z_]+)\(", src)) | set(re.findall(r"api\.(patch_node)\(", src))
    calls |= {m for m in re.findall(r"self\.api\.([a-z_]+)\b", src)}
    assert calls <= {
        "list_node", "patch_node", "list_namespaced_pod", "create_namespaced_pod", "patch_namespaced_pod",
        "delete_namespaced_pod", "read_namespaced_pod_log", "create_namespaced_service",
        "list_namespaced_config_map", "create_namespaced_config_map", "read_namespaced_config_map",
        "delete_namespaced_config_map",
    }, calls


def test_every_manifest_applies_to_the_emulator(cluster):
    api = api_for(cluster)
    core, apps, batch, rbac = (client.CoreV1Api(api), client.AppsV1Api(api), client.BatchV1Api(api),
                               client.RbacAuthorizationV1Api(api))
    create = {
        "Namespace": lambda ns, m: core.create_namespace(m),
        "ServiceAccount": core.create_namespaced_service_account,
        "ConfigMap": core.create_namespaced_config_map,
        "Service": core.create_namespaced_service,
        "PersistentVolumeClaim": core.create_namespaced_persistent_volume_claim,
        "Deployment": apps.create_namespaced_deployment,
        "DaemonSet": apps.create_namespaced_daemon_set,
        "Job": batch.create_namespaced_job,
        "Role": rbac.create_namespaced_role,
        "RoleBinding": rbac.create_namespaced_role_binding,
        "ClusterRole": lambda ns, m: rbac.create_cluster_role(m),
        "ClusterRoleBinding": lambda ns, m: rbac.create_cluster_role_binding(m),
    }
    docs = _docs()
    for doc in docs:
        model = _to_model(api, doc)
        ns = doc["metadata"].get("namespace")
        created = create[doc["kind"]](ns, model)
        assert created.metadata.name == doc["metadata"]["name"] and created.metadata.uid
    deployments = {d.metadata.name: d.spec.replicas for d in apps.list_namespaced_deployment("hai").items}
    assert deployments == {"hai-api": 2, "hai-scheduler": 2, "hai-worker": 1, "hai-kubernetes-backend": 1}
    assert [j.metadata.name for j in batch.list_namespaced_job("hai").items] == ["hai-migrate"]
    assert [d.metadata.name for d in apps.list_namespaced_daemon_set("hai").items] == ["hai-agent"]
    sa = core.read_namespaced_service_account("hai-backend", "hai")
    assert sa.metadata.name == "hai-backend"


def test_the_agent_daemonset_runs_as_root_only_with_a_user_map_from_the_manifests():
    """Issue 13: a root agent starts ranks under the accounts the admin maps; without a user map
    it would not start (hai.agent.users.root_without_user_map)."""
    from hai.agent.users import root_without_user_map, parse_user_map

    ds = next(d for d in _docs() if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "hai-agent")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["securityContext"]["runAsUser"] == 0
    cmd = c["command"]
    path = cmd[cmd.index("--user-map") + 1]
    assert root_without_user_map(0, path, False) is None and "--ranks-as-agent-user" not in cmd
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = next(d for d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    assert parse_user_map(cm["data"][path[len(mount["mountPath"].rstrip("/")) + 1:]]) == {}  # the admin fills it in
