"""The queue kept across cycles (``kept.KeptQueue``, issue 12): a cycle given the kept queue
decides exactly what the same cycle decides from scratch, cycle after cycle, while the snapshot
changes between cycles as the live service sees it (jobs arrive, running jobs end, the cycle's
own starts, suspensions, reservations and demotions are applied, suspended jobs re-enter the
queue). Several policies (the default least attained service, FIFO_LEVELS, no time-sharing, a
small preemption cap), with the fast lane on every level (so the kept lane runs on these small
queues) and as in production. A kept queue that went stale (an update broken on purpose) is
caught by the same comparison."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hai.domain.scheduler import KeptQueue, Policy, Quota, schedule
from hai.domain.scheduler import kept as kept_mod
from hai.domain.scheduler.core import _Cycle
from hai.domain.scheduler.model import FIFO_LEVELS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decision_hash import canonical  # noqa: E402
from scheduler_cycle import NOW, build_snapshot, next_snapshot, with_attained_service  # noqa: E402
from scheduler_builders import index_facts  # noqa: E402

POLICIES = {
    "least-attained-service": Policy(),
    "fifo-levels": Policy(**FIFO_LEVELS),
    "las-quantum-no-ts": Policy(time_sharing=False, service_quantum_factor=1.0, service_checkpoint_slack_s=0.0),
    "fifo-capped": Policy(**FIFO_LEVELS, max_preemptions_per_cycle=3, min_runtime_s=1800.0),
}


def _compare(pol: Policy, seed: int, cycles: int = 10, queued: int = 1500, attained: bool = True,
             delta: bool = True) -> tuple[list[int], KeptQueue]:
    """The cycles (0-based) whose decisions differ between the kept queue and from scratch.
    ``delta``: the snapshots say how their queue changed (``QueueDelta``, as the service's do);
    without, ``sync`` proves each queue job by job."""
    rng = random.Random(seed)
    snap = build_snapshot(120, 220, queued, seed)
    if attained:
        snap = with_attained_service(snap, seed)
    kept = KeptQueue()
    now, next_id = NOW, 10_000_000
    differ = []
    for k in range(cycles):
        got = schedule(snap, pol, now, kept=kept)
        want = schedule(snap, pol, now)
        if canonical(got) != canonical(want):
            differ.append(k)
        arrivals, ends = rng.choice((0, 5, 40, 200)), rng.choice((0, 3, 15))
        snap, next_id = next_snapshot(snap, want, now, rng.choice((1.0, 30.0, 600.0)), rng, arrivals, ends, next_id)
        if not delta:
            snap = replace(snap, queue_delta=None)
        now += 30.0
    return differ, kept


@pytest.mark.parametrize("lane_everywhere", [True, False])
@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_queue_decides_as_from_scratch(monkeypatch, name, seed, lane_everywhere):
    if lane_everywhere:  # the lane serves long levels only; here every level, the kept lane too
        monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)
    differ, kept = _compare(POLICIES[name], seed, attained=name != "fifo-capped")
    assert differ == []
    assert kept.rebuilds == 1  # built once, then updated: the comparison was of the kept order


@pytest.mark.parametrize("name", ["least-attained-service", "fifo-capped"])
def test_a_queue_without_an_account_of_its_changes_is_proved(monkeypatch, name):
    """The same comparison with snapshots that do not say how their queue changed: ``sync``
    proves each queue against the kept objects."""
    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)
    read = []
    real_id = kept_mod._ID
    monkeypatch.setattr(kept_mod, "_ID", lambda job: read.append(1) or real_id(job))
    differ, kept = _compare(POLICIES[name], 3, attained=name != "fifo-capped", delta=False)
    assert differ == [] and kept.rebuilds == 1
    assert len(read) > 1500 * 8  # every cycle after the first read every job's id


def test_an_account_of_the_changes_spares_the_proof(monkeypatch):
    """A snapshot whose ``queue_delta`` names the tuple of the last sync as its base is synced
    from the account, reading none of the other jobs, and decides as from scratch; an account
    based on another tuple is not used (the queue is proved), and an account that does not
    match the queue (a job it says is gone is still there) is caught by the count and the
    order is built again."""
    from hai.domain.scheduler.model import QueueDelta

    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)
    rng = random.Random(11)
    snap = with_attained_service(build_snapshot(120, 220, 1500, 11), 11)
    pol = Policy()
    kept = KeptQueue()
    d = schedule(snap, pol, NOW, kept=kept)
    read = []
    real_id = kept_mod._ID
    monkeypatch.setattr(kept_mod, "_ID", lambda job: read.append(job) or real_id(job))
    nxt, _ = next_snapshot(snap, d, NOW, 30.0, rng, 40, 10, 10_000_000)
    delta = nxt.queue_delta
    assert delta is not None and delta.base is snap.queued and delta.changed and delta.gone
    assert canonical(schedule(nxt, pol, NOW + 30.0, kept=kept)) == canonical(schedule(nxt, pol, NOW + 30.0))
    assert read == [] and kept.rebuilds == 1 and kept.accounts == 1
    assert kept.added == len(delta.changed) and kept.removed == len(delta.gone) + sum(
        1 for j in delta.changed if j.id in {q.id for q in snap.queued})
    assert [j.id for lv in kept.sync(nxt, pol) for j in lv] == [j.id for lv in KeptQueue().sync(nxt, pol) for j in lv]
    # an account against another base (not the last synced tuple): proved job by job instead
    again = replace(nxt, queued=tuple(list(nxt.queued)))  # (a new tuple of the same jobs)
    again = replace(again, queue_delta=QueueDelta(snap.queued, again.queued, delta.changed, delta.gone))
    read.clear()
    assert canonical(schedule(again, pol, NOW + 60.0, kept=kept)) == canonical(schedule(again, pol, NOW + 60.0))
    assert len(read) == len(again.queued) and kept.rebuilds == 1 and kept.accounts == 1
    # an account that does not match: a job said to be gone is still queued
    wrong = replace(again, queued=tuple(list(again.queued)))
    wrong = replace(wrong, queue_delta=QueueDelta(again.queued, wrong.queued, (), (wrong.queued[5].id,)))
    assert canonical(schedule(wrong, pol, NOW + 90.0, kept=kept)) == canonical(schedule(wrong, pol, NOW + 90.0))
    assert kept.rebuilds == 2


def test_the_snapshots_change_and_the_kept_queue_follows(monkeypatch):
    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)
    rng = random.Random(5)
    snap = build_snapshot(120, 220, 1500, 5)
    pol = Policy(**FIFO_LEVELS)
    kept = KeptQueue()
    d = schedule(snap, pol, NOW, kept=kept)
    assert d.starts or d.suspends
    snap2, _ = next_snapshot(snap, d, NOW, 30.0, rng, 50, 10, 10_000_000)
    schedule(snap2, pol, NOW + 30.0, kept=kept)
    assert kept.added >= 50 and kept.removed >= len(d.starts) and kept.rebuilds == 1
    assert sum(len(lv) for lv in kept.sync(snap2, pol)) == len(snap2.queued)


def test_a_starvation_factor_orders_from_scratch():
    # a job's class then depends on now: the kept order cannot serve, the cycle sorts itself
    snap = with_attained_service(build_snapshot(60, 100, 300, 2), 2)
    pol = Policy(starvation_factor=2.0)
    kept = KeptQueue()
    assert kept.sync(snap, pol) is None
    assert canonical(schedule(snap, pol, NOW, kept=kept)) == canonical(schedule(snap, pol, NOW))


def test_a_stale_kept_queue_is_caught(monkeypatch):
    """Break one update on purpose: a job that arrives goes to the end of its level instead of
    its place in the order (the counts still agree, so ``sync`` cannot tell). The comparison
    above must see it."""
    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)
    real_add = kept_mod.Level.add

    def add_at_end(self, job, key, c):
        if not self.blocks:
            return real_add(self, job, key, c)
        b = self.blocks[-1]
        b.insert(len(b.jobs), job, key, c, (c, job.first_submitted_at, job.id))
        self.last[-1] = max(self.last[-1], b.sk[-1])
        self.counts[c] = self.counts.get(c, 0) + 1
        self.size += 1

    monkeypatch.setattr(kept_mod.Level, "add", add_at_end)
    differ, _kept = _compare(POLICIES["fifo-levels"], 0, attained=False)
    assert differ != []


def test_a_stale_reservation_index_is_caught(monkeypatch):
    """Break another update: the kept index of jobs with reserved nodes is not told of a job
    whose reservation was stored after it entered the queue."""
    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)
    real_add = kept_mod.KeptQueue._add
    built = []

    def add_without_reservation(self, job):
        real_add(self, job)
        if built:
            self._reserved.pop(job.id, None)

    real_rebuild = kept_mod.KeptQueue._rebuild

    def rebuild(self, queued):
        real_rebuild(self, queued)
        built.append(True)

    monkeypatch.setattr(kept_mod.KeptQueue, "_add", add_without_reservation)
    monkeypatch.setattr(kept_mod.KeptQueue, "_rebuild", rebuild)
    differ, _kept = _compare(POLICIES["fifo-levels"], 0, attained=False)
    assert differ != []


def test_a_job_twice_is_not_taken_for_a_kept_queue():
    """``sync`` proves the kept order by object identity: the very objects kept, and no other.
    A snapshot holding one object twice, or two objects of one job id (a new row beside the
    kept one), is not a queue the kept order can serve: the cycle orders from scratch, and the
    kept order is still good for the next, proper snapshot."""
    from dataclasses import replace

    snap = build_snapshot(60, 100, 400, 3)
    pol = Policy(**FIFO_LEVELS)
    kept = KeptQueue()
    assert kept.sync(snap, pol) is not None and kept.rebuilds == 1
    q = snap.queued
    twice = replace(snap, queued=q + (q[7],))
    assert kept.sync(twice, pol) is None
    new_row = replace(snap, queued=q + (replace(q[7], reserved_nodes=("n0",)),))
    assert kept.sync(new_row, pol) is None
    assert canonical(schedule(new_row, pol, NOW, kept=kept)) == canonical(schedule(new_row, pol, NOW))
    levels = kept.sync(snap, pol)
    assert levels is not None and kept.rebuilds == 1 and kept.added == kept.removed == 0
    assert [j.id for lv in levels for j in lv] == [j.id for lv in KeptQueue().sync(snap, pol) for j in lv]


def test_the_very_queue_of_the_last_cycle_is_taken_without_reading_it(monkeypatch):
    """A caller whose queue did not change hands the same tuple again (``services.scheduling.
    QueueCache``, ``next_snapshot``): ``sync`` reads none of its jobs, and the cycles decide as
    from scratch while the running jobs and the clock move on; a new tuple is proved again."""
    from dataclasses import replace

    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)
    from decision_hash import canonical as canon
    from hai.domain.jobs import JobState

    rng = random.Random(7)
    snap = with_attained_service(build_snapshot(120, 220, 1500, 7), 7)
    pol = Policy()
    kept = KeptQueue()
    d = schedule(snap, pol, NOW, kept=kept)
    snap, _ = next_snapshot(snap, d, NOW, 30.0, rng, 0, 0, 10_000_000)
    assert schedule(snap, pol, NOW + 30.0, kept=kept)  # the queue after the first cycle's starts, proved
    read = []
    monkeypatch.setattr(kept_mod, "_ID", lambda job: read.append(job) or job.id)
    now = NOW + 30.0
    for _ in range(3):  # running jobs end, time passes (jobs cross their thresholds); no queued row changes
        ending = set(rng.sample([r.id for r in snap.running if r.state is not JobState.SUSPENDING], 12))
        freed: dict[str, set[int]] = {}
        for r in snap.running:
            for a in r.allocations if r.id in ending else ():
                freed.setdefault(a.node, set()).update(a.gpus)
        snap = replace(snap, running=tuple(r for r in snap.running if r.id not in ending),
                       nodes=tuple(replace(n, free_gpus=tuple(sorted(set(n.free_gpus) | freed.get(n.name, set()))))
                                   for n in snap.nodes))
        now += 900.0
        got = schedule(snap, pol, now, kept=kept)
        assert canon(got) == canon(schedule(snap, pol, now))
        assert kept.added == kept.removed == 0
    assert read == [] and kept.rebuilds == 1
    # the same jobs in a new tuple: proved job by job, still nothing to update
    again = replace(snap, queued=tuple(list(snap.queued)))
    assert again.queued is not snap.queued
    assert canon(schedule(again, pol, now, kept=kept)) == canon(schedule(again, pol, now))
    assert len(read) == len(snap.queued) and kept.added == kept.removed == 0 and kept.rebuilds == 1


def test_each_blocks_lane_keys_are_kept_across_cycles_and_equal_those_made_afresh(monkeypatch):
    """A block keeps its jobs' fast-lane keys (``Block.lane_keys``: the lane key, plus 1 past
    the wait threshold) from one cycle to the next, changed in place as jobs arrive and leave;
    after every cycle of a changing queue (small blocks, so they split), with the threshold's
    time moving on by a little or a lot, and then moved back, they are the keys made afresh."""
    monkeypatch.setattr(_Cycle, "fast_lane_min_jobs", 0)
    monkeypatch.setattr(kept_mod, "_SPLIT", 64)
    made = []
    real = kept_mod.Block.lane_keys

    def counted(self, since):
        before = self.ek
        got = real(self, since)
        made.append(got is not before)
        return got

    monkeypatch.setattr(kept_mod.Block, "lane_keys", counted)
    rng = random.Random(4)
    pol = Policy()
    snap = build_snapshot(120, 220, 1500, 4)
    kept = KeptQueue()
    now, next_id = NOW, 10_000_000
    d = schedule(snap, pol, now, kept=kept)
    for step in (1.0, 30.0, 900.0, 5.0, 3600.0, 30.0):
        snap, next_id = next_snapshot(snap, d, now, step, rng, 60, 10, next_id)
        now += step
        d = schedule(snap, pol, now, kept=kept)
        since = now - pol.wait_threshold_s
        for lv in kept.sync(snap, pol):
            for b in lv.blocks:
                fresh = [k + (q <= since) for k, q in zip(b.keys, b.qat)]
                assert b.lane_keys(since) == fresh
    assert kept.rebuilds == 1 and len(lv.blocks) > 1
    assert 0 < made.count(False) and 0 < made.count(True)  # kept in some blocks, made again in others
    # the threshold's time moved back (another policy): every key made again
    back = now - 7200.0 - pol.wait_threshold_s
    for lv in kept.sync(snap, pol):
        for b in lv.blocks:
            assert b.lane_keys(back) == [k + (q <= back) for k, q in zip(b.keys, b.qat)]
    # one block, step by step: a job arriving in a block whose jobs are all past the threshold
    # gets its +1 when the threshold reaches it, not before; a job removed takes its key along
    b = kept_mod.Block()
    job = snap.queued[0]
    for pos, (qat, key) in enumerate(((10.0, 2), (20.0, 4))):
        b.insert(pos, replace(job, id=pos, queued_at=qat), key, 0, (0, qat, pos))
    assert b.lane_keys(100.0) == [3, 5]
    b.insert(1, replace(job, id=7, queued_at=150.0), 6, 0, (0, 15.0, 7))
    assert b.lane_keys(120.0) == [3, 6, 5]
    assert b.lane_keys(150.0) == [3, 7, 5]
    b.delete(0)
    assert b.lane_keys(200.0) == [7, 5]
    b.insert(2, replace(job, id=8, queued_at=200.0), 8, 0, (0, 30.0, 8))  # queued at the threshold: past it
    assert b.lane_keys(200.0) == [7, 5, 9]


def test_the_kept_node_slots_index_as_a_fresh_build_cycle_after_cycle():
    """The caller's ``KeptQueue`` also keeps the cycle's node slots (``KeptSlots``): in every
    cycle of a changing cluster (starts, suspensions, ends, reservations left out of the
    index) the index made from them says what a fresh index says, only the slots of nodes
    whose view changed or that the last cycle took GPUs from are built again, and the cycle
    decides as from scratch; also after a cycle whose decisions were never persisted (the same
    views again, with GPUs taken from the kept slots)."""
    rng = random.Random(3)
    pol = Policy()
    snap = build_snapshot(1000, 2000, 1500, 3)
    kept = KeptQueue()
    now, next_id = NOW, 10_000_000
    rebuilt = []
    for k in range(8):
        if k % 3 == 1:  # a cycle whose decisions are lost (the service's write failed)
            assert _Cycle(snap, pol, now, kept).run().starts
        got = _Cycle(snap, pol, now, kept)
        want = _Cycle(snap, pol, now)
        assert index_facts(got.index) == index_facts(want.index)
        rebuilt.append(kept.slots.rebuilt)
        d = got.run()
        assert canonical(d) == canonical(want.run())
        snap, next_id = next_snapshot(snap, d, now, 30.0, rng, 10, 3, next_id)  # (a quarter of the views new: built in full)
        now += 30.0
    n = len(got.index.slots)  # the schedulable nodes
    assert kept.slots.built == 1 and rebuilt[0] == n
    assert all(0 < k <= n // 4 for k in rebuilt[1:])


def _charges(c: _Cycle) -> tuple[dict, dict, float]:
    """A cycle's quota charges as a full pass gives them: the GPUs used in every bucket (a bucket
    at 0 is the same as none) and the least room left."""
    q = c.quota
    return ({k: v for k, v in q.group_used.items() if v}, {k: v for k, v in q.user_used.items() if v}, q.min_headroom)


def test_the_kept_quota_charges_are_what_a_pass_over_every_running_job_charges_cycle_after_cycle():
    """The caller's ``KeptQueue`` also keeps the running jobs' GPUs by quota bucket
    (``quota.KeptCharges``), updated from each snapshot's account of the jobs that came and left
    (``RunningDelta``): in every cycle of a changing cluster (starts, suspensions, ends,
    demotions of ABOVE_NORMAL jobs past ``demote_after_s``, a quota per user added midway, a
    cycle whose decisions were lost, a snapshot whose account is of another tuple) the charges
    are those of a pass over every running job at its effective rank, and the cycle decides as
    from scratch."""
    rng = random.Random(5)
    pol = Policy(demote_after_s=600.0)
    snap = build_snapshot(1000, 2000, 1500, 5)
    kept = KeptQueue()
    now, next_id = NOW, 10_000_000
    demoted = 0
    for k in range(9):
        if k == 4:  # a user's own cap appears, its running tuple already charged without one: the
            _Cycle(snap, pol, now, kept)  # kept totals gain the per-user buckets (a full sum)
            r = snap.running[0]
            snap = replace(snap, quotas=snap.quotas + (Quota(r.group, r.priority, 10_000, user=r.user),))
        if k == 6:  # a snapshot two changes on: its account is of a tuple the keeper never saw (a full sum)
            d = schedule(snap, pol, now)
            snap, next_id = next_snapshot(snap, d, now, 60.0, rng, 20, 10, next_id)
            now += 60.0
        if k == 2:  # a cycle whose decisions are lost (the same running tuple next time)
            assert _Cycle(snap, pol, now, kept).run().starts
        got = _Cycle(snap, pol, now, kept)
        full = _Cycle(snap, pol, now)
        assert _charges(got) == _charges(full)
        assert got.facts.demoted == full.facts.demoted
        demoted += len(got.facts.demoted)
        d = got.run()
        assert canonical(d) == canonical(full.run())
        snap, next_id = next_snapshot(snap, d, now, 60.0, rng, 20, 10, next_id)
        now += 60.0
    assert demoted > 0  # the demoted jobs' charges moved to the rank they run at
    assert kept.charges.user is not None and snap.quotas[-1].user is not None
    # the first cycle, the user's cap and the account of an unseen tuple summed; the rest updated
    assert (kept.charges.sums, kept.charges.accounts) == (3, 7)


def _table_facts(c: _Cycle) -> tuple:
    """What a cycle's victim table says about the running jobs' places."""
    t = c.facts.table
    return (t.holders, t.nodes_of, t.gpus, t.lost, t.held, t.pending_for, t.pending_mark, t._pairs)


def test_a_job_of_several_nodes_is_indexed_by_its_gpus_on_each_node_with_or_without_kept_places():
    """A running job's place on several nodes (``_Place``: its nodes, its GPUs on each): two
    allocations on one node count as one holder of their GPUs together, a node outside the
    index is left out, and the table reads the same from a kept place as from the job."""
    from scheduler_builders import cluster, job

    c = cluster().zone("A", leaves=1, nodes_per_leaf=4)
    c.run(job("m").gpus(2).on("A-l0-n0", (0, 1)).on("A-l0-n1", (0, 1)).on("A-l0-n0", (2, 3))
          .on("A-l0-n3", (0, 1)).started(NOW - 7200))
    c.run(job("one").gpus(4).on("A-l0-n0", (4, 5, 6, 7)).started(NOW - 3600))
    c.unschedulable("A-l0-n3")  # (outside the index)
    c.queue(job("w").priority("HIGH").gpus(8).submitted(NOW - 5))
    snap = c.snapshot()
    kept = KeptQueue()
    for k in range(2):  # the first cycle makes the places, the second reads them
        cyc = _Cycle(snap, Policy(), NOW, kept if k else None)
        ids = [r.id for r in snap.running]
        m, one = ids.index(c.id_of("m")), ids.index(c.id_of("one"))
        t = cyc.facts.table
        n0, n1 = (cyc.index.by_name[n].ord for n in ("A-l0-n0", "A-l0-n1"))
        assert sorted(t.holders[n0]) == sorted([(m, 4), (one, 4)]) and t.holders[n1] == [(m, 2)]
        assert t.held[n0] == 8 and t.held[n1] == 2
        assert t.nodes_of[m] == (n0, n1) and t.gpus[m] == 8
        assert t._pairs is None  # two allocations on one node: the pairs are made from the holders
        singles = t.singles()
        assert sorted((p[1], p[2], p[4]) for g in singles for p in singles[g].unordered()) == sorted(
            [(4, n0, m), (2, n1, m), (4, n0, one)])
        if k:
            assert id(snap.running[m]) in kept.places.of
        else:
            _Cycle(snap, Policy(), NOW, kept).facts.table  # (the places made)


def test_the_kept_places_index_the_victim_table_as_the_jobs_allocations_do_cycle_after_cycle():
    """The caller's ``KeptQueue`` also keeps where each running job runs (``KeptPlaces``, keyed by
    the row object): in every cycle of a changing cluster (starts, suspensions, ends, jobs of
    several nodes, checkpoints reported, which make a running row a new object with the same
    job id, a node drained and back, which change the node layout, a cycle whose decisions were
    lost) the victim table built from the kept places equals one built from the jobs'
    allocations, and the cycle decides as from scratch. Entries of jobs that left are dropped
    once they are many; another layout drops them all."""
    rng = random.Random(9)
    pol = Policy()
    snap = build_snapshot(1000, 2000, 1500, 9)
    assert any(len(r.allocations) > 1 for r in snap.running)  # jobs of several nodes
    kept = KeptQueue()
    now, next_id = NOW, 10_000_000
    sizes = []
    for k in range(9):
        if k in (2, 5):  # checkpoints reported: new rows, same ids (the account no longer applies)
            running = tuple(replace(r, last_checkpoint_at=now - 5.0) if i % 3 == 0 else r
                            for i, r in enumerate(snap.running))
            snap = replace(snap, running=running, running_delta=None)
        if k == 3:  # a node drained (another layout; its job's allocation is on no indexed node)
            drained = snap.running[0].allocations[0].node
            snap = replace(snap, nodes=tuple(replace(n, schedulable=n.name != drained) for n in snap.nodes))
        if k == 4:  # and back (the layout of before)
            snap = replace(snap, nodes=tuple(replace(n, schedulable=True) for n in snap.nodes))
        if k == 6:  # a cycle whose decisions are lost
            assert _Cycle(snap, pol, now, kept).run().starts
        got = _Cycle(snap, pol, now, kept)
        full = _Cycle(snap, pol, now)
        assert _table_facts(got) == _table_facts(full)
        d = got.run()
        assert canonical(d) == canonical(full.run())
        # asked again, the kept places hold every indexed job's and, past the quarter, no more
        known = kept.places.known(got.index, snap.running)
        assert {id(snap.running[i]) for i in got.facts.members} <= known.keys()
        sizes.append((len(known), len(snap.running)))
        ends = 900 if k == 7 else 10  # many jobs end at once: their entries are dropped
        snap, next_id = next_snapshot(snap, d, now, 60.0, rng, 20, ends, next_id)
        now += 60.0
    assert kept.places.cleared == 2  # the drained layout and the one of before
    assert all(n <= r + r // 4 + 64 for n, r in sizes)
    assert sizes[-1][0] < sizes[-2][0] * 3 // 4  # the entries of the jobs that ended went
