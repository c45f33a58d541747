"""Control-plane crash loop and faults on a cluster of real processes (issue 13).

    python benchmarks/chaos.py                      # 1,000 jobs, 100 kills, then the partition runs
    python benchmarks/chaos.py --jobs 200 --kills 20 --no-partitions   # a shorter run

Starts a PostgreSQL and a Redis of its own (tests/faults/cluster.py: initdb on a free port,
redis-server on a free port; the shared servers are never touched), two API servers, the
scheduler, a Celery worker with beat and fake-GPU agents, all as separate processes. Replays
``--jobs`` short jobs of several shapes and priorities (one- and multi-node, checkpointing LOW
jobs that HIGH jobs preempt, jobs that fail by their own exit code) while SIGKILL hits the
scheduler, the API servers and the Celery worker at random moments, ``--kills`` times in all,
each restarted at once; then lets the cluster drain. The invariant monitor
(tests/faults/monitor.py) reads the database throughout; then it checks: every accepted
submission exists and ended exactly once, no GPU held twice, no attempt run twice, no false
failure, resumes from the last checkpoint, no two copies of a rank 0 at once.

Then (unless ``--no-partitions``) the agent faults: kill -9 and restart of every agent with
jobs running (reattach ratio), a short and a long SIGSTOP partition (what happens to the jobs),
and a Redis outage of ``--redis-outage-s`` (60 s).

Writes benchmarks/results/chaos.json (``--out``) and prints it; record it in
benchmarks/README.md with the load average (the VM is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
sys.path.insert(0, str(ROOT))

from tests.faults.cluster import Cluster, ThrowawayPostgres, ThrowawayRedis, wait_for  # noqa: E402
from tests.faults.crashloop import run_crash_loop  # noqa: E402
from tests.faults.monitor import InvariantMonitor  # noqa: E402


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _new_db(pg: ThrowawayPostgres, name: str) -> str:
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=hai", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return pg.url.rsplit("/", 1)[0] + "/" + name


def _rank0_alive(cluster: Cluster, ids: list[int]) -> dict[int, dict]:
    got = {}
    for jid in ids:
        alive = cluster.rank0_running(jid)
        if len(alive) != 1:
            return {}
        got[jid] = alive[0]
    return got


def agent_faults(pg: ThrowawayPostgres, rd: ThrowawayRedis, tmp: Path, redis_outage_s: float) -> dict:
    out: dict = {}
    lost_after_s = 12.0
    fast = {"HAI_AGENT__LOST_AFTER_S": str(lost_after_s), "HAI_AGENT__HEARTBEAT_INTERVAL_S": "0.5"}

    # kill -9 and restart of every agent, with ranks running (lost_after_s 30 s: a restart on a
    # loaded VM takes seconds)
    c = Cluster(tmp=tmp / "reattach", db_url=_new_db(pg, "reattach"), redis_url=rd.url.rsplit("/", 1)[0] + "/1",
                nodes=[("n0", 4), ("n1", 4), ("n2", 4), ("n3", 4)], settings={**fast, "HAI_AGENT__LOST_AFTER_S": "30"})
    c.start()
    try:
        with InvariantMonitor(c.db_url) as mon:
            ids = [c.submit(seconds=20, nodes=2, gpus_per_node=4, name="two-node")]
            ids += [c.submit(seconds=20, gpus_per_node=2, name=f"one{i}") for i in range(4)]
            wait_for(lambda: _rank0_alive(c, ids), timeout=300, what="ranks running")
            before = {(m["job"], m["rank"], m["pid"]) for m in c.read_marks() if m["ev"] == "start"}
            for a in c.agents.values():
                a.kill9()
                a.start()
            c.wait_terminal(ids, timeout=600)
            after = {(m["job"], m["rank"], m["pid"]) for m in c.read_marks() if m["ev"] == "start"}
            finished = {(m["job"], m["rank"], m["pid"]) for m in c.read_marks() if m["ev"] == "stop" and m["why"] == "done"}
            rep = mon.final(accepted=c.accepted, expected_exit=c.expected_exit, marks=c.read_marks())
        out["agent_restart"] = {"agents_killed": len(c.agents), "ranks_running_at_kill": len(before),
                                "ranks_reattached": len(before & finished), "ranks_relaunched": len(after - before),
                                "reattach_ratio": round(len(before & finished) / len(before), 3),
                                "violations": rep.violations, "load": _load()}
    finally:
        c.stop()

    # partitions (SIGSTOP of one agent): 2.5 s, then longer than lost_after_s
    for label, hold in (("short", 2.5), ("long", None)):
        c = Cluster(tmp=tmp / f"part-{label}", db_url=_new_db(pg, f"part_{label}"),
                    redis_url=rd.url.rsplit("/", 1)[0] + ("/2" if label == "short" else "/3"), settings=fast)
        c.start()
        try:
            with InvariantMonitor(c.db_url) as mon:
                jid = c.submit(seconds=25, gpus_per_node=4, checkpoint_every=1.0, name=f"part-{label}")
                first = wait_for(lambda: _rank0_alive(c, [jid]), timeout=300, what="rank 0")[jid]
                wait_for(lambda: c.job(jid)["last_checkpoint"], timeout=120, what="a checkpoint")
                agent = c.agents[first["node"]]
                t0 = time.time()
                agent.freeze()
                if hold is not None:
                    wait_for(lambda: time.time() > t0 + hold, timeout=hold + 5, interval=0.05, what="the hold")
                else:
                    wait_for(lambda: c.nodes_state()[first["node"]] == "lost", timeout=120, what="lost")
                    wait_for(lambda: any(m["ev"] == "start" and m["job"] == jid and m["node"] != first["node"]
                                         for m in c.read_marks()), timeout=120, what="restart elsewhere")
                held_s = time.time() - t0
                agent.thaw()
                job = c.wait_terminal([jid], timeout=600)[jid]
                marks = c.read_marks()
                stop = [m for m in marks if m["pid"] == first["pid"] and m["ev"] == "stop"]
                rep = mon.final(accepted=c.accepted, expected_exit=c.expected_exit, marks=marks)
            out[f"partition_{label}"] = {
                "frozen_s": round(held_s, 1), "lost_after_s": lost_after_s, "final_state": job["state"],
                "attempts": job["attempt"], "restarts": job["restarts"],
                "node_lost": any(e["to_state"] == "queued" and "lost" in e["reason"] for e in job["events"]),
                "old_copy_ended_by": stop[0]["why"] if stop else None,
                "old_copy_fenced_before_new_start_s": (
                    round(min(m["t"] for m in marks if m["ev"] == "start" and m["node"] != first["node"]) - stop[0]["t"], 2)
                    if stop and label == "long" else None),
                "rank0_overlaps": len(rep.rank0_overlaps), "violations": rep.violations, "load": _load()}
        finally:
            c.stop()

    # Redis away for redis_outage_s while jobs run and are submitted
    c = Cluster(tmp=tmp / "redis", db_url=_new_db(pg, "redis_outage"), redis_url=rd.url.rsplit("/", 1)[0] + "/4",
                settings={**fast, "HAI_AGENT__LOST_AFTER_S": "30"})
    c.start()
    try:
        with InvariantMonitor(c.db_url) as mon:
            ids = [c.submit(seconds=20, gpus_per_node=2, name=f"r{i}") for i in range(2)]
            wait_for(lambda: _rank0_alive(c, ids), timeout=300, what="ranks running")
            rd.stop()
            t0 = time.time()
            during = []
            while time.time() < t0 + redis_outage_s:
                during.append(c.submit(seconds=1, gpus_per_node=1, name="during"))
                time.sleep(2)
            done_during = sum(1 for j in during if c.job(j)["state"] == "succeeded")
            rd.start()
            mark = len(c.worker.log.read_text(errors="replace"))
            c.wait_terminal([*ids, *during], timeout=600)
            wait_for(lambda: "reap_lost_nodes" in c.worker.log.read_text(errors="replace")[mark:], timeout=180,
                     what="beat's reaper after Redis returned")
            rep = mon.final(accepted=c.accepted, expected_exit=c.expected_exit, marks=c.read_marks())
        out["redis_outage"] = {"outage_s": redis_outage_s, "submitted_during": len(during),
                               "succeeded_during_outage": done_during, "periodic_work_resumed": True,
                               "violations": rep.violations, "states": rep.states, "load": _load()}
    finally:
        c.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=8, help="fake-GPU agents of 4 GPUs")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--rate", type=float, default=4.0, help="submissions per second")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--redis-outage-s", type=float, default=60.0)
    ap.add_argument("--no-partitions", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chaos.json")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="hai-chaos-"))
    pg = ThrowawayPostgres()
    rd = ThrowawayRedis(tmp / "redis")
    result: dict = {"load_before": _load(), "cpus": os.cpu_count()}
    try:
        cluster = Cluster(tmp=tmp / "crashloop", db_url=_new_db(pg, "crashloop"), redis_url=rd.url,
                          nodes=[(f"n{i}", 4) for i in range(args.nodes)], servers=args.servers,
                          settings={"HAI_AGENT__LOST_AFTER_S": "30", "HAI_AGENT__HEARTBEAT_INTERVAL_S": "0.5"})
        cluster.start()
        try:
            t0 = time.time()
            run = run_crash_loop(cluster, jobs=args.jobs, kills=args.kills, seed=args.seed,
                                 drain_timeout_s=7200, submit_rate_hz=args.rate)
            crash = run.as_dict()
            crash["wall_s"] = round(time.time() - t0, 1)
            crash["violations"] = run.report.violations
            crash["load_after"] = _load()
            result["crash_loop"] = crash
        finally:
            cluster.stop()
        print(json.dumps(result["crash_loop"], indent=2), flush=True)
        if not args.no_partitions:
            result.update(agent_faults(pg, rd, tmp, args.redis_outage_s))
    finally:
        pg.close()
        rd.close()
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
