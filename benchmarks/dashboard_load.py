"""Dashboard load times and bundle size (issue 11), in Debian's chromium through Playwright.

Seeds an embedded (SQLite) platform with 1,250 nodes of 8 GPUs (two zones, leaves of 20 nodes,
GPU figures as a heartbeat leaves them) and 10,000 jobs (every state, events and allocations),
starts `hai server` on it serving frontend/dist, and measures in the browser the time from
navigation start (performance.now()) until
  - /jobs shows its first rows (the newest 1,000 of the 10,000 jobs, virtualised table), and
  - /cluster shows every one of the 1,250 node links in the fat-tree;
first load (cold cache) and the median of reloads. Also sums the gzipped size of the production
JavaScript (all chunks, and the chunks the first page loads).

    python benchmarks/dashboard_load.py [--jobs 10000] [--nodes 1250] [--out results.json]
(build first: `make frontend`)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))

import httpx  # noqa: E402

from hai.db.base import utcnow  # noqa: E402
from hai.db.migrate import upgrade  # noqa: E402
from hai.db.models import Job, JobAllocation, JobEvent, Node  # noqa: E402
from hai.protocol import GpuMetrics  # noqa: E402
from hai.services import auth, metrics_store  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.settings import Settings  # noqa: E402

DIST = REPO / "frontend" / "dist"
CHROMIUM = os.environ.get("HAI_TEST_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
STATES = ["queued"] * 3 + ["running"] * 3 + ["succeeded"] * 2 + ["failed", "cancelled"]
PRIORITIES = ["LOW", "NORMAL", "NORMAL", "ABOVE_NORMAL", "HIGH", "VERY_HIGH"]


def bundle_sizes() -> dict:
    assets = sorted((DIST / "assets").glob("*.js"))
    sizes = {p.name: len(gzip.compress(p.read_bytes(), 9)) for p in assets}
    index = (DIST / "index.html").read_text()
    first = [n for n in sizes if n in index]
    return {"total_js_gzip_kb": round(sum(sizes.values()) / 1024, 1),
            "first_page_js_gzip_kb": round(sum(sizes[n] for n in first) / 1024, 1),
            "chunks": len(sizes), "largest_chunks_gzip_kb": {n: round(s / 1024, 1) for n, s in
                                                             sorted(sizes.items(), key=lambda kv: -kv[1])[:4]}}


def seed(settings: Settings, n_nodes: int, n_jobs: int) -> str:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    platform = Platform.from_settings(settings)
    rng = random.Random(11)
    now = utcnow()
    with platform.sessions() as s:
        user, token = auth.create_user(session=s, name="admin", group="ops", is_admin=True)
        users = [auth.create_user(session=s, name=f"user{i}", group=f"group{i % 5}")[0] for i in range(20)]
        nodes = []
        for i in range(n_nodes):
            zone = "A" if i < n_nodes // 2 else "B"
            node = Node(
                name=f"node-{i + 1:04d}", zone=zone, leaf=f"{zone}-leaf{(i % (n_nodes // 2)) // 20 + 1:02d}", gpus=8,
                state=rng.choice(["ready"] * 40 + ["draining", "drained", "unhealthy", "lost"]),
                last_heartbeat_at=now, gpu_inventory=[{"index": g, "uuid": f"G{i}-{g}", "model": "A100", "memory_total_mib": 40960} for g in range(8)],
            )
            metrics_store.set_latest_gpus(node, [  # as the heartbeat leaves them
                GpuMetrics(index=g, uuid=f"G{i}-{g}", util_pct=round(rng.uniform(0, 100), 1), memory_used_mib=1000,
                           memory_total_mib=40960, temperature_c=50.0, power_w=200.0) for g in range(8)], settings)
            nodes.append(node)
        s.add_all(nodes)
        s.flush()
        for j in range(n_jobs):
            u = rng.choice(users)
            state = rng.choice(STATES)
            created = now - timedelta(seconds=rng.uniform(60, 7 * 86400))
            started = created + timedelta(seconds=rng.uniform(1, 3600)) if state != "queued" else None
            job = Job(name=f"train-{j}", user_id=u.id, user_name=u.name, group=u.group, command=["python", "train.py"],
                      state=state, priority=rng.choice(PRIORITIES), nodes=rng.choice([1, 1, 1, 2, 4]),
                      gpus_per_node=8, created_at=created, queued_at=created, started_at=started,
                      finished_at=started + timedelta(seconds=600) if state in ("succeeded", "failed", "cancelled") else None,
                      pending_reason="waiting for 8 free GPUs in one zone (HIGH jobs ahead)" if state == "queued" else None,
                      attempt=1 if started else 0)
            s.add(job)
            s.flush()
            s.add(JobEvent(job_id=job.id, at=created, from_state=None, to_state="queued", reason="submitted"))
            if started:
                s.add(JobEvent(job_id=job.id, at=started, from_state="queued", to_state="starting", reason="placed"))
                s.add(JobAllocation(job_id=job.id, attempt=1, node_name=rng.choice(nodes).name, node_rank=0,
                                    gpus=list(range(8)), active=state == "running", created_at=started))
        s.commit()
    platform.close()
    return token


def free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def measure(url: str, token: str, n_nodes: int, reloads: int) -> dict:
    from playwright.sync_api import sync_playwright

    out: dict[str, list[float]] = {"jobs": [], "cluster": [], "tree_response": [], "tree_render": []}
    # where a /cluster load's time goes: navigation start -> the tree's response has arrived
    # (app start + the server's answer), and from there until every node link is in the DOM
    tree_js = ("(() => { const r = performance.getEntriesByType('resource')"
               ".filter((e) => new URL(e.name).pathname === '/api/v1/cluster/nodes'); return r.length ? r[0].responseEnd : null })()")
    with tempfile.TemporaryDirectory(prefix="hai-bench-chromium-") as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=FLAGS,
                                                   viewport={"width": 1400, "height": 900})
        ctx.set_default_timeout(60_000)
        ctx.add_init_script(f"window.localStorage.setItem('hai.token', {json.dumps(token)})")
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        for i in range(reloads + 1):
            page.goto(url + "/jobs")
            page.locator("tbody tr[data-job-id]").first.wait_for()
            out["jobs"].append(page.evaluate("performance.now()"))
            page.goto(url + "/cluster")
            page.wait_for_function(f"document.querySelectorAll('a.node').length === {n_nodes}")
            out["cluster"].append(page.evaluate("performance.now()"))
            arrived = page.evaluate(tree_js)
            out["tree_response"].append(arrived)
            out["tree_render"].append(out["cluster"][-1] - arrived)
            if i == 0:
                shots = REPO / "test-results" / "bench"
                shots.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(shots / "cluster-1250.png"), full_page=False)
                page.goto(url + "/jobs")
                page.locator("tbody tr[data-job-id]").first.wait_for()
                page.screenshot(path=str(shots / "jobs-10000.png"))
        page.goto(url + "/jobs")
        page.wait_for_function("document.querySelector('[role=status]') && /newest/.test(document.body.innerText)")
        rows_in_dom = page.locator("tbody tr[data-job-id]").count()  # of the 1,000 loaded: virtualised
        ctx.close()
    return {
        "jobs_first_load_ms": round(out["jobs"][0]), "jobs_reload_median_ms": round(statistics.median(out["jobs"][1:])),
        "jobs_reload_min_ms": round(min(out["jobs"][1:])),
        "cluster_first_load_ms": round(out["cluster"][0]),
        "cluster_reload_median_ms": round(statistics.median(out["cluster"][1:])),
        "cluster_reload_min_ms": round(min(out["cluster"][1:])),
        "cluster_tree_response_ms": [round(x) for x in out["tree_response"]],
        "cluster_tree_render_ms": [round(x) for x in out["tree_render"]],
        "job_rows_in_dom": rows_in_dom,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--reloads", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not (DIST / "index.html").exists():
        sys.exit("build the dashboard first: make frontend")
    with tempfile.TemporaryDirectory(prefix="hai-bench-") as tmp:
        data = Path(tmp) / "hai"
        settings = Settings(data_dir=data)
        t0 = time.perf_counter()
        token = seed(settings, args.nodes, args.jobs)
        seeded_s = time.perf_counter() - t0
        port = free_port()
        env = {**os.environ, "HAI_FRONTEND_DIST": str(DIST), "HAI_DATA_DIR": str(data), "HAI_AGENT__LOST_AFTER_S": "1e9"}
        log = (Path(tmp) / "server.log").open("w")
        server = subprocess.Popen([sys.executable, "-m", "hai.cli.main", "server", "--port", str(port), "--data-dir", str(data)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    sys.exit(f"server did not start: {(Path(tmp) / 'server.log').read_text()[-2000:]}")
                time.sleep(0.2)
            h = {"Authorization": f"Bearer {token}"}
            t1 = time.perf_counter()
            page = httpx.get(url + "/api/v1/jobs", params={"limit": 1000}, headers=h, timeout=60).json()
            api_jobs_ms = (time.perf_counter() - t1) * 1000
            assert page["total"] == args.jobs, page["total"]
            t1 = time.perf_counter()
            assert len(httpx.get(url + "/api/v1/cluster/nodes", headers=h, timeout=60).json()) == args.nodes
            api_nodes_ms = (time.perf_counter() - t1) * 1000
            t1 = time.perf_counter()
            assert len(httpx.get(url + "/api/v1/jobs", params={"limit": 50}, headers=h, timeout=60).json()["items"]) == 50
            api_jobs_50_ms = (time.perf_counter() - t1) * 1000
            result = {
                "benchmark": "dashboard_load", "jobs": args.jobs, "nodes": args.nodes, "database": "sqlite (embedded)",
                "seed_s": round(seeded_s, 1), "api_jobs_page_1000_ms": round(api_jobs_ms),
                "api_cluster_nodes_ms": round(api_nodes_ms), "api_jobs_page_50_ms": round(api_jobs_50_ms),
                "load_average_before": os.getloadavg()[0], **measure(url, token, args.nodes, args.reloads),
                "load_average_after": os.getloadavg()[0],
                "bundle": bundle_sizes(), "cpu_count": os.cpu_count(),
            }
        finally:
            server.terminate()
            server.wait(30)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
