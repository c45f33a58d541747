"""The simulator's idle-cycle rules (sim/skipping.py) rely only on what a scheduler declares
about itself and on the domain's victim rules."""

from __future__ import annotations

from dataclasses import replace

import random

import pytest

from hai.domain.jobs import Priority
from hai.domain.scheduler import Policy, schedule
from hai.domain.scheduler.model import FIFO_LEVELS
from hai.domain.scheduler.victims import may_take_turn, outranks
from hai.domain.topology import fire_flyer
from hai.sim.engine import Simulation
from hai.sim.fifo import FifoScheduler
from hai.sim.trace import TraceJob


def _trace(seed: int, prios: list[str]) -> list[TraceJob]:
    rng = random.Random(seed)
    jobs = []
    for i in range(1, 120):
        gpus = rng.choice([1, 2, 4, 8, 16])
        nodes, per = ((gpus + 7) // 8, 8) if gpus > 8 else (1, gpus)
        jobs.append(
            TraceJob(i, float(rng.randint(0, 30_000)), float(rng.choice([60, 600, 3000, 9000])), gpus, nodes, per,
                     Priority(rng.choice(prios)), rng.choice("abc"), "g")
        )  # fmt: skip
    jobs.sort(key=lambda j: (j.submit_s, j.id))
    return jobs


def test_the_rules_read_the_schedulers_declared_traits():
    topo = fire_flyer(nodes=2, zones=1, nodes_per_leaf=2)
    hai = Simulation(topo, [], policy=Policy(**FIFO_LEVELS)).rules
    fifo = Simulation(topo, [], policy=Policy(**FIFO_LEVELS), scheduler=FifoScheduler(seed=0)).rules
    assert (hai.starts_every_fit, hai.strict_order) == (True, False)
    assert (fifo.starts_every_fit, fifo.strict_order) == (False, True)


@pytest.mark.parametrize("prios", [["NORMAL"], ["LOW", "NORMAL", "HIGH"]])
def test_a_scheduler_that_declares_nothing_gets_the_coarse_rules_and_the_same_decisions(prios):
    """The hai policy behind a plain function (no ``starts_every_fit``): the simulator may not
    use the finer node-level rules, and its skipping still changes no decision."""
    jobs = _trace(3, prios)
    topo = fire_flyer(nodes=4, zones=2, nodes_per_leaf=2)
    pol = replace(Policy(**FIFO_LEVELS), quantum_s=3600, wait_threshold_s=600, min_runtime_s=300)
    out = []
    for scheduler, skip in ((schedule, False), (lambda s, p, t: schedule(s, p, t), True)):
        sim = Simulation(topo, jobs, policy=pol, scheduler=scheduler)
        sim.skip_idle_cycles = skip
        if skip:
            assert not sim.rules.starts_every_fit and not sim.rules.node_rules
        m = sim.run().metrics
        out.append(({k: v for k, v in m.items() if k != "cycles"}, sim.job_results(), m["cycles"]))
    assert out[0][0] == out[1][0] and out[0][1] == out[1][1]
    assert out[1][2] < out[0][2]


def test_the_victim_rules_the_simulator_asks():
    assert outranks(Priority.HIGH.rank, Priority.LOW.rank) and not outranks(Priority.LOW.rank, Priority.LOW.rank)
    r = Priority.NORMAL.rank
    assert may_take_turn(r, "ann", r, "bob")
    assert not may_take_turn(r, "ann", r, "ann")  # never the waiter's own job
    assert not may_take_turn(r, "ann", Priority.LOW.rank, "bob")  # (a lower one is plain preemption)
