"""End to end, issues 10 + 11: an admin drains a node from its page with a reason, sees it change
state, then undrains it. Needs issue 10's node endpoints (drain, undrain, node detail)."""

from __future__ import annotations

import pytest

from tests.e2e.browser import chromium_page, dashboard_env, sign_in
from tests.e2e.conftest import start_stack, stop_stack, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def dash(tmp_path):
    s = start_stack(tmp_path, agents=2, gpus_per_agent=2, extra_env=dashboard_env())
    yield s
    stop_stack(s)


def test_an_admin_drains_a_node_with_a_reason_and_undrains_it(dash, request):
    with dash.client() as c:
        node = c.get("/api/v1/nodes").json()[0]["name"]
    with chromium_page(request.node.name) as (page, shot):
        sign_in(page, dash)
        page.goto(f"{dash.url}/nodes/{node}")
        page.locator(".badge-ready").first.wait_for()
        shot(page, "node-ready")
        page.get_by_label("Reason").fill("replacing a fan (ticket 42)")
        page.get_by_role("button", name="Drain", exact=True).click()
        page.locator(".badge-drained").first.wait_for(timeout=60_000)
        page.get_by_text("replacing a fan (ticket 42)").first.wait_for()
        with dash.client() as c:
            got = c.get(f"/api/v1/nodes/{node}").json()
        assert got["state"] == "drained" and "replacing a fan" in got["state_reason"]
        assert page.get_by_role("button", name="Drain", exact=True).count() == 0
        shot(page, "node-drained")
        page.get_by_role("button", name="Undrain").click()
        wait_for(lambda: dash.client().get(f"/api/v1/nodes/{node}").json()["state"] == "ready", timeout=120,
                 what="the node to pass validation and be ready")
        page.locator("p .badge-ready").first.wait_for()
        shot(page, "node-undrained")
