"""Only backend/hai/integrations/kubernetes/ imports `kubernetes`; the in-pod wrapper (and the
package's __init__, imported with it inside job images) is stdlib-only."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.unit.test_layering import PKG, _imports

K8S = PKG / "integrations" / "kubernetes"


def test_only_the_kubernetes_integration_imports_kubernetes():
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if K8S not in p.parents and any(n.split(".")[0] == "kubernetes" for n in _imports(p))]
    assert offenders == []
    assert any(n.split(".")[0] == "kubernetes" for n in _imports(K8S / "backend.py"))  # the rule can fail


def test_pod_wrapper_is_stdlib_only():
    allowed = set(sys.stdlib_module_names)
    for name in ("podwrap.py", "__init__.py"):
        bad = [n for n in _imports(K8S / name) if n.split(".")[0] not in allowed]
        assert bad == [], name
