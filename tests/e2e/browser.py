"""Browser helpers for the dashboard tests: Debian's chromium driven by Playwright (the Python
package; `playwright install` is not needed), a fresh profile per test, and a screenshot of
every page a test visits under test-results/e2e/<test>/ (HAI_TEST_OUTPUT overrides the root)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.conftest import REPO, Stack

CHROMIUM = os.environ.get("HAI_TEST_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
OUTPUT = Path(os.environ.get("HAI_TEST_OUTPUT", REPO / "test-results")) / "e2e"
DIST = REPO / "frontend" / "dist"


def dashboard_env() -> dict[str, str]:
    """What a stack serving the dashboard needs: the built files, 5 s metric buckets written within a second."""
    if not (DIST / "index.html").exists():
        pytest.fail("frontend/dist is not built: run `make frontend` (make test builds it)")
    return {"HAI_FRONTEND_DIST": str(DIST), "HAI_METRICS__FLUSH_INTERVAL_S": "1", "HAI_METRICS__FINE_S": "5",
            "HAI_METRICS__IDLE_AFTER_S": "5"}


@dataclass
class Shots:
    folder: Path
    n: int = 0
    taken: list[Path] = field(default_factory=list)

    def __call__(self, page, name: str) -> Path:  # noqa: ANN001
        self.n += 1
        path = self.folder / f"{self.n:02d}-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.png"
        page.screenshot(path=str(path), full_page=True)
        self.taken.append(path)
        return path


@contextmanager
def chromium_page(test_name: str) -> Iterator[tuple[object, Shots]]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (backend[test])")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run installs it)")
    folder = OUTPUT / re.sub(r"[^A-Za-z0-9_.-]+", "_", test_name)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    profile = tempfile.mkdtemp(prefix="hai-chromium-")
    try:
        with sync_api.sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=FLAGS, viewport={"width": 1400, "height": 900},
            )
            ctx.set_default_timeout(20_000)
            try:
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                yield page, Shots(folder)
            finally:
                ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def sign_in(page, stack: Stack, token: str | None = None) -> None:  # noqa: ANN001
    page.goto(stack.url + "/")
    page.get_by_label("API token").fill(token or stack.admin_token)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("button", name="Sign out").wait_for()
