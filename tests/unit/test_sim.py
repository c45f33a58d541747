"""The trace simulator: trace parsing, the checkpoint/restart model, metrics, the fifo baseline,
independent checks of the decisions, and the `hai sim` / `hai topology` commands."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from hai.cli.sim import policy_from_settings, sim, topology_app
from hai.domain.jobs import Priority
from hai.domain.scheduler import Allocation, Decisions, Policy, Quota, Start, schedule
from hai.domain.scheduler.model import FIFO_LEVELS
from hai.domain.topology import fire_flyer, from_crux
from hai.sim.engine import SimConfig, Simulation
from hai.sim.fifo import FifoScheduler
from hai.sim.trace import TraceError, TraceJob, parse_trace
from typer.testing import CliRunner

CRUX = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "crux_topology.csv"

ISSUE_KEYS = {
    "policy", "jobs", "completed", "avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s",
    "avg_queue_s_by_priority", "gpu_utilization", "makespan_s", "preemptions", "lost_gpu_s",
    "multi_node_jobs", "min_leaves_ratio", "cross_zone_jobs", "double_allocations", "quota_violations",
}  # fmt: skip


def tj(id_, at, dur, gpus=8, prio="NORMAL", user="u", group="g"):
    nodes, per = ((gpus + 7) // 8, 8) if gpus > 8 else (1, gpus)
    return TraceJob(id_, float(at), float(dur), gpus, nodes, per, Priority(prio), user, group)


def one_node():
    return fire_flyer(nodes=1, zones=1, nodes_per_leaf=1)


# -- traces ----------------------------------------------------------------------------------------


def test_parse_trace_dates_sorting_shapes_and_tenants():
    text = (
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-09 07:01:55,66.0,1,66.0,vcA\n"
        "2017-10-09 07:00:00,100,16,1600,vcB\n"
        "2017-10-09 07:00:00,5,12,60,vcB\n"
        "2017-10-09 07:02:00,5,0,0,vcB\n"
    )
    jobs, skipped = parse_trace(text)
    assert skipped == 1  # zero GPUs
    assert [(j.id, j.submit_s, j.duration_s) for j in jobs] == [(1, 0.0, 100.0), (2, 0.0, 5.0), (3, 115.0, 66.0)]
    assert [(j.nodes, j.gpus_per_node, j.num_gpus) for j in jobs] == [(2, 8, 16), (2, 8, 12), (1, 1, 1)]
    assert [(j.user, j.group) for j in jobs] == [("vcB", "vcB"), ("vcB", "vcB"), ("vcA", "vcA")]
    assert all(j.priority == Priority.NORMAL for j in jobs)


def test_parse_trace_seconds_priority_user_group_time_scale_limit():
    text = "timestamp,duration,num_gpus,priority,user,group\n100,10,8,high,ann,vision\n40,10,4,LOW,bob,nlp\n70,1,1,,cat,nlp\n"
    jobs, _ = parse_trace(text, time_scale=2.0, limit=2)
    assert [(j.submit_s, j.priority, j.user, j.group) for j in jobs] == [
        (0.0, Priority.LOW, "bob", "nlp"),
        (15.0, Priority.NORMAL, "cat", "nlp"),
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("timestamp,num_gpus\n1,1\n", "duration"),
        ("timestamp,duration,num_gpus\nyesterday,1,1\n", "neither seconds nor a date time"),
        ("timestamp,duration,num_gpus,priority\n1,1,1,URGENT\n", "unknown priority"),
    ],
)
def test_parse_trace_errors(text, message):
    with pytest.raises(TraceError, match=message):
        parse_trace(text)


# -- the job model -----------------------------------------------------------------------------------


def test_a_job_on_an_empty_cluster_runs_for_its_duration():
    s = Simulation(one_node(), [tj(1, 5, 1000)], policy=Policy(**FIFO_LEVELS))
    m = s.run().metrics
    assert m["completed"] == 1 and m["avg_jct_s"] == 1000.0 and m["avg_queue_s"] == 0.0
    assert m["makespan_s"] == 1000.0 and m["gpu_utilization"] == 1.0
    assert m["preemptions"] == 0 and m["lost_gpu_s"] == 0.0


def test_suspension_loses_work_since_the_last_checkpoint_and_pays_checkpoint_and_restart_costs():
    jobs = [tj(1, 0, 10_000, prio="LOW", user="a"), tj(2, 1000, 500, prio="HIGH", user="b")]
    s = Simulation(
        one_node(),
        jobs,
        policy=replace(Policy(**FIFO_LEVELS), min_runtime_s=600),
        config=SimConfig(checkpoint_interval_s=300, checkpoint_cost_s=10, restart_cost_s=30),
    )
    m = s.run().metrics
    r = s.job_results()
    # at 1000 s the LOW job is asked to stop: its last checkpoint was at 900 s, 100 s are lost;
    # it stops 10 s later, the HIGH job runs 1010..1510, the LOW job restarts (30 s) and redoes
    # the remaining 10000 - 900 s of work: ends at 1510 + 30 + 9100
    assert r[2]["first_start_s"] == 1010 and r[2]["end_s"] == 1510
    assert r[1]["end_s"] == 1510 + 30 + 9100
    assert r[1]["suspensions"] == 1
    assert m["preemptions"] == 1
    assert m["lost_gpu_s"] == 100 * 8
    assert m["overhead_gpu_s"] == (10 + 30) * 8
    assert m["avg_queue_s_by_priority"] == {"LOW": 500.0, "HIGH": 10.0}


def test_a_job_that_would_finish_while_stopping_just_finishes():
    jobs = [tj(1, 0, 1005, prio="LOW", user="a"), tj(2, 1000, 100, prio="HIGH", user="b")]
    s = Simulation(one_node(), jobs, policy=replace(Policy(**FIFO_LEVELS), min_runtime_s=600), config=SimConfig(checkpoint_cost_s=10))
    m = s.run().metrics
    r = s.job_results()
    assert r[1]["end_s"] == 1005 and r[1]["suspensions"] == 0
    assert r[2]["first_start_s"] == 1005
    assert m["lost_gpu_s"] == 0


def test_time_sharing_in_the_simulator():
    jobs = [tj(1, 0, 20_000, user="a"), tj(2, 10, 100, user="b")]
    pol = replace(Policy(**FIFO_LEVELS), quantum_s=3600, wait_threshold_s=900)
    s = Simulation(one_node(), jobs, policy=pol, config=SimConfig(checkpoint_interval_s=300))
    s.run()
    r = s.job_results()
    # the long job yields at its quantum (a checkpoint boundary: nothing lost) to the waiting job
    assert r[2]["first_start_s"] == pytest.approx(3610, abs=1e-3)
    assert r[1]["suspensions"] == 1
    assert r[1]["end_s"] == pytest.approx(3710 + 30 + 16_400, abs=1e-3)


@pytest.mark.parametrize("interval, starts", [(1.0, [1.0, 1.0]), (0.0, [0.3, 0.7])])
def test_cycles_run_on_the_scheduler_interval_grid(interval, starts):
    jobs = [TraceJob(1, 0.3, 10.0, 1, 1, 1, Priority.NORMAL, "u", "g"), TraceJob(2, 0.7, 10.0, 1, 1, 1, Priority.NORMAL, "u", "g")]
    s = Simulation(one_node(), jobs, policy=Policy(**FIFO_LEVELS), config=SimConfig(cycle_interval_s=interval))
    m = s.run().metrics
    assert [r["first_start_s"] for r in s.job_results().values()] == starts
    assert [r["end_s"] for r in s.job_results().values()] == [x + 10.0 for x in starts]
    assert m["cycles"] == (1 if interval else 2)


def test_jobs_that_can_never_fit_are_rejected_not_queued_forever():
    s = Simulation(fire_flyer(nodes=4, zones=2, nodes_per_leaf=2), [tj(1, 0, 10, gpus=24), tj(2, 0, 10)], policy=Policy(**FIFO_LEVELS))
    m = s.run().metrics
    assert m["rejected"] == 1 and m["completed"] == 1 and m["unfinished"] == 0


def test_metrics_have_every_key_the_issue_lists():
    jobs = [tj(i, i * 10, 100 + i, gpus=[1, 4, 16][i % 3], user=f"u{i % 3}") for i in range(1, 30)]
    m = Simulation(fire_flyer(nodes=8, zones=2, nodes_per_leaf=2), jobs, policy=Policy(**FIFO_LEVELS)).run().metrics
    assert ISSUE_KEYS <= set(m)
    assert m["jobs"] == 29 and m["completed"] == 29
    assert m["multi_node_jobs"] == 10
    assert m["min_leaves_ratio"] == 1.0
    assert m["cross_zone_jobs"] == 0 and m["double_allocations"] == 0 and m["quota_violations"] == 0


@pytest.mark.parametrize(
    "prios, seed", [(["LOW", "NORMAL", "NORMAL", "ABOVE_NORMAL", "HIGH"], 5), (["NORMAL"], 6), (["NORMAL"], 7)]
)
def test_skipping_idle_cycles_changes_no_decision(prios, seed):
    """The simulator skips cycles that cannot decide anything new (arrivals on a full cluster,
    ends nobody fits, wake-ups whose rule cannot fire): the same replay with a cycle after
    every event must give exactly the same result (with one priority the finer node-level
    time-sharing rules apply)."""
    import random

    rng = random.Random(seed)
    jobs = []
    for i in range(1, 160):
        jobs.append(
            tj(
                i,
                rng.randint(0, 40_000),
                rng.choice([60, 600, 3000, 9000, 30_000]),
                gpus=rng.choice([1, 1, 2, 4, 8, 16]),
                prio=rng.choice(prios),
                user=rng.choice("abcd"),
            )
        )
    jobs.sort(key=lambda j: (j.submit_s, j.id))
    topo = fire_flyer(nodes=6, zones=2, nodes_per_leaf=2)
    pol = replace(Policy(**FIFO_LEVELS), quantum_s=3600, wait_threshold_s=600, min_runtime_s=300, demote_after_s=900)
    results = []
    for skip in (False, True):
        s = Simulation(topo, jobs, policy=pol)
        s.skip_idle_cycles = skip
        m = s.run().metrics
        results.append((m, s.job_results()))
    (m0, r0), (m1, r1) = results
    assert m1["cycles"] < m0["cycles"]
    assert {k: v for k, v in m0.items() if k != "cycles"} == {k: v for k, v in m1.items() if k != "cycles"}
    assert r0 == r1
    assert m0["preemptions"] > 0 and m0["completed"] == len(jobs)


def test_the_simulation_is_deterministic():
    jobs = [tj(i, i * 7 % 50, 100 + (i * 37) % 900, gpus=[1, 2, 8, 16][i % 4], user=f"u{i % 4}") for i in range(1, 60)]
    topo = fire_flyer(nodes=8, zones=2, nodes_per_leaf=2)
    a = Simulation(topo, jobs, policy=Policy(**FIFO_LEVELS)).run().metrics
    b = Simulation(topo, jobs, policy=Policy(**FIFO_LEVELS)).run().metrics
    assert a == b
    f1 = Simulation(topo, jobs, policy=Policy(**FIFO_LEVELS), scheduler=FifoScheduler(seed=3), policy_name="fifo").run().metrics
    f2 = Simulation(topo, jobs, policy=Policy(**FIFO_LEVELS), scheduler=FifoScheduler(seed=3), policy_name="fifo").run().metrics
    assert f1 == f2 and f1["policy"] == "fifo"


# -- the fifo baseline --------------------------------------------------------------------------------


def test_fifo_blocks_behind_its_head_where_hai_backfills():
    topo = fire_flyer(nodes=2, zones=1, nodes_per_leaf=2)
    jobs = [tj(1, 0, 1000), tj(2, 1, 500, gpus=16), tj(3, 2, 10, gpus=1)]
    fifo = Simulation(topo, jobs, policy=Policy(**FIFO_LEVELS), scheduler=FifoScheduler(), policy_name="fifo")
    fifo.run()
    hai = Simulation(topo, jobs, policy=replace(Policy(**FIFO_LEVELS), time_sharing=False))
    hai.run()
    assert fifo.job_results()[3]["first_start_s"] == 1500  # behind the 2-node head job
    assert hai.job_results()[3]["first_start_s"] == 2  # backfilled on the idle node


def test_fifo_places_on_random_nodes_and_may_span_zones():
    topo = fire_flyer(nodes=8, zones=2, nodes_per_leaf=2)
    jobs = [tj(i, 0, 100, gpus=16) for i in range(1, 5)]
    m = Simulation(topo, jobs, policy=Policy(**FIFO_LEVELS), scheduler=FifoScheduler(seed=1), policy_name="fifo").run().metrics
    assert m["cross_zone_jobs"] >= 1  # zone-unaware
    h = Simulation(topo, jobs, policy=Policy(**FIFO_LEVELS)).run().metrics
    assert h["cross_zone_jobs"] == 0 and h["min_leaves_ratio"] == 1.0


# -- independent checks --------------------------------------------------------------------------------


def test_double_allocations_and_quota_violations_are_caught():
    def greedy(snapshot, policy, now):  # a broken scheduler: everything on node 0, GPUs 0..n
        d = Decisions()
        node = snapshot.nodes[0].name
        for q in snapshot.queued:
            d.starts.append(Start(q.id, (Allocation(node, tuple(range(q.gpus_per_node))),), "broken"))
        return d

    jobs = [tj(1, 0, 100, gpus=4, group="g"), tj(2, 0, 100, gpus=4, group="g")]
    s = Simulation(one_node(), jobs, policy=Policy(**FIFO_LEVELS), scheduler=greedy, quotas=(Quota("g", Priority.NORMAL, 2),))
    m = s.run().metrics
    assert m["double_allocations"] >= 1
    assert m["quota_violations"] >= 1


def test_hai_keeps_quotas_in_the_simulator():
    jobs = [tj(i, 0, 100, gpus=4, group="g", user=f"u{i}") for i in range(1, 5)]
    s = Simulation(fire_flyer(nodes=2, zones=1, nodes_per_leaf=2), jobs, policy=Policy(**FIFO_LEVELS), quotas=(Quota("g", Priority.NORMAL, 8),))
    m = s.run().metrics
    r = s.job_results()
    assert m["quota_violations"] == 0 and m["completed"] == 4
    assert sorted(x["first_start_s"] for x in r.values()) == [0, 0, 100, 100]


# -- the commands ----------------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(topology_app, name="topology")
    app.command("sim")(sim)
    return app


def test_topology_fire_flyer_command(tmp_path):
    r = CliRunner().invoke(_app(), ["topology", "fire-flyer", "--nodes", "40", "--zones", "2", "--nodes-per-leaf", "10"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "node,gpus,leaf,zone" and len(lines) == 41
    out = tmp_path / "t.csv"
    r = CliRunner().invoke(_app(), ["topology", "fire-flyer", "--nodes", "4", "--out", str(out)])
    assert r.exit_code == 0 and out.read_text().count("\n") == 5


@pytest.mark.skipif(not CRUX.exists(), reason="shared data not present")
def test_topology_from_crux_command():
    r = CliRunner().invoke(_app(), ["topology", "from-crux", str(CRUX)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 848 and all(line.endswith(",G6") for line in lines[1:])


def test_topology_from_crux_missing_file_fails_cleanly(tmp_path):
    r = CliRunner().invoke(_app(), ["topology", "from-crux", str(tmp_path / "nope.csv")])
    assert r.exit_code == 2 and "cannot read" in r.output


@pytest.mark.parametrize("policy_name", ["hai", "fifo", "las", "easy-fs"])
def test_sim_command_json(tmp_path, policy_name):
    topo = tmp_path / "topo.csv"
    trace = tmp_path / "trace.csv"
    CliRunner().invoke(_app(), ["topology", "fire-flyer", "--nodes", "8", "--zones", "2", "--nodes-per-leaf", "2", "--out", str(topo)])
    trace.write_text("timestamp,duration,num_gpus\n" + "".join(f"{i * 30},{600 + i},{[1, 8, 16][i % 3]}\n" for i in range(40)))
    args = ["sim", "--topology", str(topo), "--trace", str(trace), "--policy", policy_name, "--json"]
    args += ["--time-scale", "2", "--limit", "30", "--checkpoint-interval-s", "60", "--checkpoint-cost-s", "5", "--restart-cost-s", "7"]
    r = CliRunner().invoke(_app(), args)
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    assert ISSUE_KEYS <= set(m)
    assert m["policy"] == policy_name and m["jobs"] == 30 and m["completed"] == 30
    human = CliRunner().invoke(_app(), args[:7] + ["--limit", "5"])
    assert human.exit_code == 0 and "avg JCT" in human.stdout


def test_sim_command_rejects_an_unknown_policy(tmp_path):
    r = CliRunner().invoke(_app(), ["sim", "--topology", "x", "--trace", "y", "--policy", "sjf"])
    assert r.exit_code == 2 and "must be one of hai, fifo, las, easy-fs" in r.output


def test_sim_reads_scheduler_durations_from_settings(monkeypatch):
    from hai.settings import get_settings

    monkeypatch.setenv("HAI_SCHEDULER__MIN_RUNTIME_S", "123")
    monkeypatch.setenv("HAI_SCHEDULER__QUANTUM_S", "456")
    monkeypatch.setenv("HAI_SCHEDULER__WAIT_THRESHOLD_S", "7")
    monkeypatch.setenv("HAI_SCHEDULER__DEMOTE_AFTER_S", "89")
    monkeypatch.setenv("HAI_SCHEDULER__USAGE_HALF_LIFE_S", "10")
    get_settings.cache_clear()
    try:
        p = policy_from_settings()
    finally:
        get_settings.cache_clear()
    assert (p.min_runtime_s, p.quantum_s, p.wait_threshold_s, p.demote_after_s, p.usage_half_life_s) == (123, 456, 7, 89, 10)
    assert replace(p, min_runtime_s=Policy(**FIFO_LEVELS).min_runtime_s).preemption


def test_simulator_calls_the_same_domain_scheduler():
    s = Simulation(one_node(), [tj(1, 0, 1)], policy=Policy(**FIFO_LEVELS))
    assert s.scheduler is schedule
    assert from_crux  # the converter is importable from the domain


@pytest.mark.parametrize("classes, expect_ok", [((1000.0,), True), ((), False)])
def test_the_fewest_leaves_check_reads_the_queue_in_the_policys_order(classes, expect_ok):
    """A node reserved in this cycle by a job that comes first in the policy's queue was not
    usable. With least attained service on, a later job of a lower service class comes first:
    job 2 (class 0, submitted after) reserved node 1 this cycle, so job 1 (class 1: 2,000
    GPU-seconds attained) had one idle node on each leaf and two leaves were the fewest. In
    FIFO order (no classes) job 2 comes after job 1, node 1 was usable, and one leaf was."""
    sim = Simulation(fire_flyer(nodes=4, zones=1, nodes_per_leaf=2), [tj(1, 0, 5000, gpus=16), tj(2, 10, 5000), tj(3, 0, 9e5)],
                     policy=replace(Policy(**FIFO_LEVELS), service_classes_gpu_s=classes))  # fmt: skip
    n = [node.name for node in sim.nodes]
    leaves = [node.leaf for node in sim.nodes]
    assert leaves[0] == leaves[1] != leaves[2] == leaves[3]  # two leaves: nodes 0, 1 | nodes 2, 3
    sim._hold(sim.jobs[3], (Allocation(n[3], tuple(range(8))),))  # job 3 runs on node 3
    x, owner = sim.jobs[1], sim.jobs[2]
    x.attained, x.queued_since, owner.queued_since = 2000.0, 0.0, 10.0
    allocs = (Allocation(n[0], tuple(range(8))), Allocation(n[2], tuple(range(8))))
    assert sim._min_leaves_ok(x, allocs, before={}, after={2: (n[1],)}, t=20.0) is expect_ok


@pytest.mark.parametrize(
    "arrive, suspended_at, lost",
    [
        (920.0, 920.0, 20 * 8),  # 20 s after job 1's checkpoint at 900 s: within the 60-s slack
        (1000.0, None, 0),  # 100 s after it: job 1 is no victim; no later event, so job 2 waits for its end
    ],
)
def test_service_classes_see_each_running_jobs_current_checkpoint(arrive, suspended_at, lost):
    """With service classes the simulator keeps a running job's last checkpoint current in the
    snapshot, as the live one is (checkpoints every 300 s here): the checkpoint-boundary rule and
    the least-lost victim choice read it. (A stale view, its start, would make job 1 no victim at
    920 s.)"""
    pol = replace(Policy(**FIFO_LEVELS), service_classes_gpu_s=(1000.0,), min_runtime_s=600, time_sharing=False, service_checkpoint_slack_s=60)
    s = Simulation(one_node(), [tj(1, 0, 5000, user="a"), tj(2, arrive, 100, user="b")], policy=pol,
                   config=SimConfig(checkpoint_interval_s=300, checkpoint_cost_s=10, restart_cost_s=30))  # fmt: skip
    m = s.run().metrics
    r = s.job_results()
    assert m["lost_gpu_s"] == lost
    if suspended_at is None:
        assert r[1]["suspensions"] == 0 and r[2]["first_start_s"] == 5000
    else:
        assert r[1]["suspensions"] == 1 and r[2]["first_start_s"] == suspended_at + 10
