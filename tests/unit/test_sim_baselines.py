"""The simulator's baselines behave as their papers say, on tiny hand-made traces:
``las`` (Tiresias 2D-LAS) and ``easy-fs`` (Slurm-style fair share + EASY backfill)."""

from __future__ import annotations

from dataclasses import replace

from hai.domain.jobs import Priority
from hai.domain.scheduler import Policy
from hai.domain.scheduler.model import FIFO_LEVELS
from hai.domain.topology import fire_flyer
from hai.sim.easy_fs import EasyFsScheduler
from hai.sim.engine import SimConfig, Simulation
from hai.sim.las import DEFAULT_THRESHOLDS, LasScheduler
from hai.sim.trace import TraceJob

CFG = SimConfig(checkpoint_interval_s=300, checkpoint_cost_s=10, restart_cost_s=30, cycle_interval_s=1)


def tj(id_, at, dur, gpus=8, user="u", group=None):
    nodes, per = ((gpus + 7) // 8, 8) if gpus > 8 else (1, gpus)
    return TraceJob(id_, float(at), float(dur), gpus, nodes, per, Priority.NORMAL, user, group or user)


def run(scheduler, jobs, nodes=1, policy=replace(Policy(**FIFO_LEVELS), min_runtime_s=900)):
    s = Simulation(fire_flyer(nodes=nodes, zones=1, nodes_per_leaf=max(1, nodes)), jobs, policy=policy, scheduler=scheduler, config=CFG)
    m = s.run().metrics
    return m, s.job_results()


# -- las -------------------------------------------------------------------------------------------


def test_las_uses_tiresias_released_thresholds():
    las = LasScheduler()
    assert DEFAULT_THRESHOLDS == (3250.0, 7200.0)
    assert [las.queue_of(a) for a in (0, 3249, 3250, 7199, 7200, 1e9)] == [0, 0, 1, 1, 2, 2]


def test_las_a_short_newcomer_preempts_a_job_with_more_attained_service():
    # the long job has 8 GPUs x 2000 s = 16,000 GPU-s at t=2000 (queue 2): the newcomer (queue 0)
    # takes its GPUs; the long job loses the 200 s since its checkpoint at 1800 and restarts later
    m, r = run(LasScheduler(), [tj(1, 0, 10_000), tj(2, 2000, 100, user="v")])
    assert r[2]["first_start_s"] == 2010 and r[2]["end_s"] == 2110
    assert r[1]["suspensions"] == 1
    assert r[1]["end_s"] == 2110 + 30 + (10_000 - 1800)
    assert m["preemptions"] == 1 and m["lost_gpu_s"] == 200 * 8


def test_las_respects_the_minimum_runtime_and_wakes_when_a_threshold_is_crossed():
    # at t=100 both are in queue 0 (long: 800 GPU-s) and FIFO keeps the long job; it crosses
    # 3,250 GPU-s at t=406.25 but may be suspended only after its 900 s minimum runtime
    m, r = run(LasScheduler(), [tj(1, 0, 10_000), tj(2, 100, 100, user="v")])
    assert r[2]["first_start_s"] == 910
    assert r[1]["suspensions"] == 1


def test_las_is_fifo_within_a_queue_and_duration_blind():
    # three queue-0 jobs on a full node: the first-submitted starts first, whatever its length
    jobs = [tj(1, 0, 300), tj(2, 1, 5000, user="v"), tj(3, 2, 100, user="w")]
    _m, r = run(LasScheduler(), jobs)
    assert r[1]["first_start_s"] == 0
    assert r[2]["first_start_s"] == 300  # before the shorter job 3: same queue, submitted first
    # job 2 reaches queue 1 (3,250 GPU-s) after 406 s and its minimum runtime at 1200: job 3 takes over
    assert r[3]["first_start_s"] == 1210


def test_las_never_preempts_for_a_job_of_the_same_queue_running_jobs_stay_ahead():
    # Tiresias moves waiting jobs behind the running ones of their queue after every round, so
    # only a job of a queue with less attained service preempts. Job 2 (queue 0) takes over from
    # job 1 (queue 2 at 900 s: 7,200 GPU-s) once its minimum runtime is over; when job 2 is
    # demoted into queue 2 at 1810 it lands behind job 1, which resumes and then keeps its GPUs to
    # the end (queue 2 is the last): two preemptions in all, not one per minimum runtime
    m, r = run(LasScheduler(), [tj(1, 0, 20_000), tj(2, 100, 20_000, user="v")])
    assert r[2]["first_start_s"] == 910
    assert r[1]["end_s"] == 1820 + 30 + (20_000 - 900)  # resumed at 1820, never suspended again
    assert r[2]["end_s"] == r[1]["end_s"] + 30 + (20_000 - 900)
    assert r[1]["suspensions"] == r[2]["suspensions"] == 1 and m["preemptions"] == 2


def test_las_starvation_knob_moves_a_starved_job_back_to_queue_zero():
    # with solve_starvation=1 a job suspended after running 900 s is promoted to queue 0 once it
    # has waited 900 s, and preempts the other (queue 2): the two take turns instead of job 2
    # waiting for job 1's end (40,080 s without the knob)
    m, r = run(LasScheduler(starvation=1.0), [tj(1, 0, 20_000), tj(2, 100, 20_000, user="v")])
    assert r[1]["suspensions"] >= 2 and r[2]["suspensions"] >= 2
    assert r[1]["end_s"] > 20_950  # job 1 no longer runs to its end undisturbed
    assert m["double_allocations"] == m["invalid_decisions"] == 0


def test_las_never_double_allocates_or_crosses_zones_on_a_mixed_trace():
    jobs = [tj(i, i * 40, 300 + (i * 137) % 4000, gpus=[1, 2, 8, 16][i % 4], user=f"u{i % 3}") for i in range(60)]
    s = Simulation(fire_flyer(nodes=4, zones=2, nodes_per_leaf=1), jobs, policy=Policy(**FIFO_LEVELS), scheduler=LasScheduler(), config=CFG)
    m = s.run().metrics
    assert m["completed"] == 60
    assert m["double_allocations"] == m["cross_zone_jobs"] == m["invalid_decisions"] == 0
    assert m["min_leaves_ratio"] == 1.0


# -- easy-fs ---------------------------------------------------------------------------------------


def test_easy_backfills_a_job_that_ends_before_the_heads_reservation_and_never_delays_the_head():
    jobs = [
        tj(1, 0, 1000, gpus=4),  # runs 0..1000
        tj(2, 1, 500, gpus=8, user="b"),  # the head: needs the whole node, reserved from t=1000
        tj(3, 2, 500, gpus=4, user="c"),  # ends at 502 <= 1000: backfilled now
        tj(4, 600, 2000, gpus=4, user="d"),  # would end after 1000 on the reserved node: waits
    ]
    m, r = run(EasyFsScheduler(), jobs)
    assert r[3]["first_start_s"] == 2 and r[3]["end_s"] == 502
    assert r[2]["first_start_s"] == 1000  # the head starts at its shadow time, not delayed
    assert r[4]["first_start_s"] == 1500  # after the head, not backfilled into its hole
    assert m["preemptions"] == 0


def test_easy_backfills_long_jobs_off_the_reserved_nodes():
    # two nodes: the head (8 GPUs) is reserved node of job 1; a long 4-GPU job fits on the other
    jobs = [tj(1, 0, 1000, gpus=8), tj(5, 0, 1000, gpus=4, user="x"), tj(2, 1, 100, gpus=8, user="b"), tj(3, 2, 9000, gpus=4, user="c")]
    _m, r = run(EasyFsScheduler(), jobs, nodes=2)
    assert r[3]["first_start_s"] == 2
    assert r[2]["first_start_s"] == 1000


def test_easy_orders_by_fair_share_the_tenant_with_less_decayed_usage_first():
    jobs = [tj(1, 0, 1000, user="x"), tj(2, 10, 100, user="x"), tj(3, 20, 100, user="y")]
    _m, r = run(EasyFsScheduler(), jobs)
    assert r[3]["first_start_s"] == 1000  # y has used nothing: ahead of x's earlier job
    assert r[2]["first_start_s"] == 1100


def test_easy_usage_decays_with_the_half_life():
    s = EasyFsScheduler(half_life_s=100)
    s.held = {"g": 1}
    s.last = 0.0
    s._roll(100.0)
    # integral of 1 GPU over 100 s with decay: (1 - 1/2) / (ln 2 / 100)
    assert abs(s.usage["g"] - 50 / 0.6931471805599453) < 1e-6
    s.held = {}
    s._roll(200.0)
    assert abs(s.usage["g"] - 25 / 0.6931471805599453) < 1e-6
