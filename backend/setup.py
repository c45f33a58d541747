"""Ships the repository's Alembic tree (and a built dashboard, when there is one) inside the package.

The migrations are written in one place, the repository's top-level ``migrations/`` (with
``alembic.ini`` beside it). A build copies them into the wheel as ``hai/_shipped/migrations`` and
``hai/_shipped/alembic.ini``, and ``frontend/dist`` (when ``npm run build`` made it) as
``hai/_shipped/dashboard``. The sdist carries the same copies, so the wheel that
``python -m build`` makes from the sdist has them too. Nothing is copied into the source tree: an
editable install keeps using the top-level files (see hai/db/migrate.py and hai/main.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
SHIPPED = Path("hai") / "_shipped"
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def _sources() -> dict[str, Path]:
    """name -> where it comes from: the repository around backend/, else (an unpacked sdist) the
    copies the sdist carries."""
    repo = HERE.parent
    found: dict[str, Path] = {}
    for name, path in (
        ("migrations", repo / "migrations"),
        ("alembic.ini", repo / "alembic.ini"),
        ("dashboard", repo / "frontend" / "dist"),
    ):
        if name == "dashboard" and not (path / "index.html").is_file():
            path = HERE / SHIPPED / name
        elif not path.exists():
            path = HERE / SHIPPED / name
        if path.exists():
            found[name] = path
    if "migrations" not in found or "alembic.ini" not in found:
        raise RuntimeError(f"no Alembic tree found next to {HERE} (expected {repo / 'migrations'})")
    return found


def _copy(target_root: Path) -> None:
    target = target_root / SHIPPED
    for name, src in _sources().items():
        dst = target / name
        if dst.resolve() == src.resolve():
            continue  # building from the sdist's own copy
        if dst.exists():
            shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=IGNORE)
        else:
            shutil.copy2(src, dst)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            _copy(Path(self.build_lib))


class Sdist(sdist):
    def make_release_tree(self, base_dir, files) -> None:  # noqa: ANN001
        super().make_release_tree(base_dir, files)
        _copy(Path(base_dir))


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
