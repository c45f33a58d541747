"""The layering rules of DESIGN.md, enforced on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "backend" / "hai"
FORBIDDEN_IN_DOMAIN = ("sqlalchemy", "redis", "celery", "httpx", "fastapi", "kubernetes", "starlette", "hai.services", "hai.db", "hai.api")
AGENT_MAY_IMPORT = ("hai.protocol", "hai.sdk", "hai.agent")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize("path", _files("domain"), ids=lambda p: str(p.relative_to(PKG)))
def test_domain_is_pure(path):
    bad = [n for n in _imports(path) if n.split(".")[0] in FORBIDDEN_IN_DOMAIN or n.startswith(FORBIDDEN_IN_DOMAIN)]
    assert bad == []


@pytest.mark.parametrize("path", _files("agent"), ids=lambda p: str(p.relative_to(PKG)))
def test_agent_imports_only_protocol_and_sdk(path):
    bad = [n for n in _imports(path) if n.startswith("hai") and not n.startswith(AGENT_MAY_IMPORT)]
    assert bad == []


@pytest.mark.parametrize("path", _files("sdk"), ids=lambda p: str(p.relative_to(PKG)))
def test_sdk_is_stdlib_only(path):
    import sys

    allowed = set(sys.stdlib_module_names) | {"hai"}
    lazy_ok = {"torch"}  # used only when the training script already imported it
    bad = [n for n in _imports(path) if n.split(".")[0] not in allowed | lazy_ok]
    assert bad == []


def test_nothing_but_services_transition_writes_job_state():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "jobs.py" and path.parent.name == "services":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and t.attr == "state" and isinstance(t.value, ast.Name) and t.value.id == "job":
                        offenders.append(str(path.relative_to(PKG)))
    assert offenders == []


def test_nothing_but_services_node_state_writes_node_state():
    """Issue 10: every node state change goes through services/node_state.set_node_state (and a
    new node's first state through create_node there)."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "node_state.py" and path.parent.name == "services":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "state" and isinstance(t.value, ast.Name) and t.value.id in ("node", "n"):
                    offenders.append(f"{path.relative_to(PKG)}:{node.lineno}")
            # Node(..., state=...) outside the state module
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Node":
                if any(k.arg == "state" for k in node.keywords):
                    offenders.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert offenders == []
