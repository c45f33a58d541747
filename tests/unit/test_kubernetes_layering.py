"""Only backend/hai/integrations/kubernetes/ imports `kubernetes`; the in-pod wrapper (and the
package's __init__, imported with it inside job images) is stdlib-only."""

from __future__ import annotations

import sys

from tests.unit.test_layering import PKG, _imports

K8S = PKG / "integrations" / "kubernetes"


def test_only_the_kubernetes_integration_imports_kubernetes():
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if K8S not in p.parents and any(n.split(".")[0] == "kubernetes" for n in _imports(p))]
    assert offenders == []
    assert any(n.split(".")[0] == "kubernetes" for n in _imports(K8S / "backend.py"))  # the rule can fail


# stdlib-only modules of the platform the wrapper may use (hfreduce's NUMA/NIC binding shares the
# agent launcher's sysfs readers); each is itself held to the same rule below, with its packages
STDLIB_ONLY_HAI = {"hai.agent.topology": PKG / "agent" / "topology.py"}


def test_pod_wrapper_is_stdlib_only():
    allowed = set(sys.stdlib_module_names)
    files = {"podwrap.py": K8S / "podwrap.py", "__init__.py": K8S / "__init__.py",
             **{m: f for m, f in STDLIB_ONLY_HAI.items()},
             "hai/__init__.py": PKG / "__init__.py", "hai/agent/__init__.py": PKG / "agent" / "__init__.py"}
    for name, path in files.items():
        bad = [n for n in _imports(path) if n.split(".")[0] not in allowed and n not in STDLIB_ONLY_HAI]
        assert bad == [], name
