"""End to end, issue 11: the dashboard in a real chromium against `hai dev` (API server,
scheduler, four fake-GPU agents over two zones and four leaves). Each test saves a screenshot of
every page it visits under test-results/e2e/<test>/."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.e2e.browser import chromium_page, dashboard_env, sign_in
from tests.e2e.conftest import start_stack, stop_stack, wait_for

pytestmark = pytest.mark.e2e

TERMINAL = {"succeeded", "failed", "cancelled"}
SDK_LOOP = (
    "import time\nfrom hai import sdk\n"
    "for i in range(100000):\n"
    "    if sdk.should_suspend():\n"
    "        sdk.suspend_ready()\n"
    "        break\n"
    "    print('tick', i, flush=True)\n"
    "    time.sleep(0.2)\n"
)


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("dash"), agents=4, gpus_per_agent=2, extra_env=dashboard_env())
    yield s
    stop_stack(s)


def _state_on_page(page, state: str) -> None:  # noqa: ANN001
    page.locator(f".job-page .badge-{state}").first.wait_for()


def test_sign_in_submit_with_a_validation_error_then_watch_the_job_run_and_its_logs_stream(dash, request):
    with chromium_page(request.node.name) as (page, shot):
        page.goto(dash.url + "/")
        page.get_by_label("API token").fill("not-a-token")
        page.get_by_role("button", name="Sign in").click()
        page.get_by_text("not accepted").wait_for()
        shot(page, "sign-in-wrong-token")
        sign_in(page, dash)
        for name in ("Jobs", "Submit", "Cluster", "Nodes", "Usage"):
            assert page.get_by_role("link", name=name, exact=True).is_visible()

        page.get_by_role("link", name="Submit", exact=True).click()
        page.get_by_label("Name").fill("ui-job")
        page.get_by_label("Command").fill("bash -c 'for i in $(seq 1 60); do echo line $i; sleep 0.25; done'")
        page.get_by_label("GPUs per node").fill("9")
        page.get_by_label("Environment").fill("GREETING=hello")
        page.get_by_role("button", name="Submit").click()
        err = page.locator("#f-gpus-error")
        err.wait_for()
        assert "8" in err.inner_text()  # "less than or equal to 8", beside the GPUs field
        assert page.get_by_label("GPUs per node").get_attribute("aria-invalid") == "true"
        assert re.search(r"/submit$", page.url)
        shot(page, "submit-validation-error")

        page.get_by_label("GPUs per node").fill("1")
        page.get_by_role("button", name="Submit").click()
        page.wait_for_url(re.compile(r"/jobs/\d+$"))
        job_id = int(page.url.rsplit("/", 1)[1])
        assert dash.job(job_id)["env"] == {"GREETING": "hello"}
        _state_on_page(page, "running")
        log = page.get_by_label("Log")
        wait_for(lambda: "line 3" in log.inner_text(), timeout=30, what="the first log lines in the page")
        early = log.inner_text().count("\n")
        shot(page, "job-running-logs")
        # more lines arrive without a reload: the stream follows
        wait_for(lambda: log.inner_text().count("\n") > early + 5, timeout=30, what="log lines to stream in")
        _state_on_page(page, "succeeded")
        assert "line 60" in log.inner_text()
        page.get_by_text("finished (succeeded)").wait_for()
        shot(page, "job-succeeded")

        # a deep link survives a reload (served index.html), and the jobs list links to the job
        page.reload()
        _state_on_page(page, "succeeded")
        page.get_by_role("link", name="Jobs", exact=True).click()
        page.get_by_role("link", name="ui-job").first.wait_for()
        shot(page, "jobs-list")


def test_cancel_a_job_and_suspend_and_resume_another_from_their_pages(dash, request):
    sleeper = dash.submit(name="to-cancel", gpus_per_node=1, command=["sleep", "600"])
    sdk_job = dash.submit(name="to-suspend", gpus_per_node=1, suspend_grace_s=10,
                          command=[sys.executable, "-c", SDK_LOOP])
    with chromium_page(request.node.name) as (page, shot):
        sign_in(page, dash)
        page.goto(f"{dash.url}/jobs/{sleeper['id']}")
        _state_on_page(page, "running")
        shot(page, "job-to-cancel-running")
        page.get_by_role("button", name="Cancel job").click()
        _state_on_page(page, "cancelled")
        assert dash.job(sleeper["id"])["state"] == "cancelled"
        assert page.get_by_role("button", name="Cancel job").count() == 0
        shot(page, "job-cancelled")

        page.goto(f"{dash.url}/jobs/{sdk_job['id']}")
        _state_on_page(page, "running")
        page.get_by_text("tick 2").wait_for()
        page.get_by_role("button", name="Suspend").click()
        page.get_by_role("button", name="Resume").wait_for(timeout=60_000)
        held = dash.job(sdk_job["id"])
        assert held["held"] and held["state"] == "queued" and held["suspensions"] == 1
        page.get_by_text("suspend requested").first.wait_for()
        shot(page, "job-suspended")
        page.get_by_role("button", name="Resume").click()
        wait_for(lambda: (j := dash.job(sdk_job["id"]))["state"] == "running" and j["attempt"] == 2, timeout=60,
                 what="the job to run again")
        page.get_by_text("resumed").first.wait_for()
        _state_on_page(page, "running")
        shot(page, "job-resumed")
        page.get_by_role("button", name="Cancel job").click()
        _state_on_page(page, "cancelled")


def test_cluster_page_shows_every_node_under_its_leaf_and_zone(dash, request):
    busy = dash.submit(name="busy", gpus_per_node=2, command=["sleep", "600"])
    dash.wait_state(busy["id"], {"running"})
    with dash.client() as c:
        nodes = c.get("/api/v1/nodes").json()
    assert {(n["zone"], n["leaf"]) for n in nodes} == {("A", "A1"), ("A", "A2"), ("B", "B1"), ("B", "B2")}
    with chromium_page(request.node.name) as (page, shot):
        sign_in(page, dash)
        page.goto(dash.url + "/cluster")
        for n in nodes:
            cell = page.locator(f'section[aria-label="Zone {n["zone"]}"] section[aria-label="Leaf {n["leaf"]}"]') \
                .get_by_role("link", name=n["name"], exact=True)
            cell.wait_for()
            assert cell.get_attribute("href") == f"/nodes/{n['name']}"
        assert page.locator("a.node").count() == len(nodes)
        # totals and the utilisation chart are drawn from what the agents reported
        page.locator(".totals").get_by_text("Allocated").wait_for()
        page.locator("figure.chart canvas").first.wait_for()
        # selecting the job highlights its node
        placed = {p["node"] for p in dash.job(busy["id"])["placement"]}
        page.get_by_label("Highlight job").select_option(str(busy["id"]))
        wait_for(lambda: {el.get_attribute("aria-label") for el in page.locator("a.node.highlighted").all()} == placed,
                 timeout=10, what="the job's nodes to be highlighted")
        shot(page, "cluster")
        page.locator(".fat-tree").get_by_role("link", name=sorted(placed)[0], exact=True).click()
        page.get_by_role("heading", name=f"Node {sorted(placed)[0]}").wait_for()
        page.get_by_role("link", name=f"job {busy['id']}").wait_for()
        # the node's GPUs come from GET /nodes/{name} (the list carries no per-GPU figures: issue 12)
        gpus = page.locator("table", has=page.get_by_role("columnheader", name="ECC uncorrected")).locator("tbody tr")
        wait_for(lambda: gpus.count() == next(n["gpus"] for n in nodes if n["name"] == sorted(placed)[0]),
                 timeout=10, what="a row per GPU of the node")
        shot(page, "node-page")
        page.get_by_role("link", name="Nodes", exact=True).click()
        for n in nodes:
            page.get_by_role("link", name=n["name"], exact=True).wait_for()
        # the utilisation column: each node's mean at its latest heartbeat (gpu_util_pct)
        reporting = [n["name"] for n in nodes if n["gpu_util_pct"] is not None]
        assert reporting, nodes
        wait_for(lambda: "%" in page.get_by_role("row").filter(
            has=page.get_by_role("link", name=reporting[0], exact=True)).inner_text(),
            timeout=10, what="the node's GPU utilisation in the list")
        shot(page, "nodes")
        page.get_by_role("link", name="Usage", exact=True).click()
        page.get_by_role("cell", name="admin", exact=True).wait_for()
        shot(page, "usage")
    out = dash.cli("usage", "--by", "user", check=True)
    assert re.search(r"^admin\s+\d+\.\d\d\s+\d+", out.stdout, re.M), out.stdout
    bad = dash.cli("usage", "--since", "yesterday-ish")
    assert bad.returncode == 2 and "--since" in bad.stderr
    with dash.client() as c:
        c.post(f"/api/v1/jobs/{busy['id']}/cancel")


def test_a_non_admin_sees_no_drain_button(dash, request):
    out = subprocess.run([sys.executable, "-m", "hai.cli.main", "admin", "create-user", "eve", "--group", "vision",
                          "--data-dir", str(dash.data_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    with dash.client() as c:
        node = c.get("/api/v1/nodes").json()[0]["name"]
    with chromium_page(request.node.name) as (page, shot):
        sign_in(page, dash, token)
        page.get_by_text("eve (vision)").wait_for()
        page.goto(f"{dash.url}/nodes/{node}")
        page.get_by_role("heading", name=f"Node {node}").wait_for()
        page.locator(".badge-ready").first.wait_for()
        assert page.get_by_role("button", name="Drain").count() == 0
        assert page.get_by_role("button", name="Undrain").count() == 0
        assert page.get_by_role("button", name="Validate now").count() == 0
        page.locator("figure.chart canvas").first.wait_for()  # the GPU chart (uPlot loads with it)
        shot(page, "node-as-non-admin")
        page.get_by_role("button", name="Sign out").click()
        page.get_by_label("API token").wait_for()
        shot(page, "signed-out")
