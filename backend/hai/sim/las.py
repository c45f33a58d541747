"""Baseline ``--policy las``: Tiresias' discretised two-dimensional least-attained-service
(Gu et al., NSDI'19, "Tiresias: A GPU Cluster Manager for Distributed Deep Learning"), restated
on our snapshot from its paper and its released simulator (SymbioticLab/Tiresias,
``simulator/jobs.py`` and ``run_sim.py``'s ``dlas-gpu``).

* A job's attained service is its GPU-time so far: GPUs x seconds it has held them, over all its
  attempts (Tiresias: ``executed_time * num_gpu``). It is duration-blind.
* Queues by attained service: ``thresholds`` (GPU-seconds) split it into len+1 queues; the
  simulator's defaults are ``queue_limit = [3250, 7200, 18000]`` with ``num_queue = 3``, i.e.
  thresholds 3,250 and 7,200 GPU-s (``DEFAULT_THRESHOLDS``). Queue 0 first; FIFO (first
  submission) within a queue.
* Each cycle, every running and queued job in that order is granted GPUs while the cluster's
  GPU count lasts (Tiresias counts GPUs, then places); a running job outside that set is
  suspended (preemptive), a queued job inside it starts where it fits.
* Starvation knob (Tiresias ``solve_starvation``, off by default as in its runs): a queued job
  that waited ``starvation`` times its executed time goes back to queue 0.

What it shares with ours, so only the policy differs: the placement rules
(``baseline_common.place``), the simulator's checkpoint and restart costs (a suspension loses
the progress since the last checkpoint, costs ``checkpoint_cost_s`` and a restart
``restart_cost_s``) and the minimum runtime: a job that has run less than the policy's
``min_runtime_s`` in its attempt is not suspended (it keeps its GPUs, counted first).
"""

from __future__ import annotations

from bisect import bisect_right

from hai.domain.jobs import JobState
from hai.domain.scheduler.model import Decisions, Policy, Snapshot, Start, Suspend, SuspendCode
from hai.domain.scheduler.placement import FreeIndex
from hai.sim.baseline_common import Baseline, place

DEFAULT_THRESHOLDS = (3250.0, 7200.0)


class LasScheduler(Baseline):
    def __init__(self, thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS, starvation: float = 0.0):
        super().__init__()
        self.thresholds = tuple(sorted(thresholds))
        self.starvation = starvation

    def queue_of(self, attained_gpu_s: float) -> int:
        return bisect_right(self.thresholds, attained_gpu_s)

    def __call__(self, snapshot: Snapshot, policy: Policy, now: float) -> Decisions:
        sim = self.sim
        assert sim is not None, "bind(sim) first"
        th = self.thresholds
        d = Decisions()
        min_rt = policy.min_runtime_s
        cap = sum(n.gpus for n in snapshot.nodes if n.schedulable)
        cands: list[tuple[int, float, int, object]] = []
        crossings: list[float] = []
        pinned_until: list[float] = []
        for r in snapshot.running:
            g = r.gpu_count
            if r.state == JobState.SUSPENDING:
                cap -= g
                continue
            a = sim.attained_gpu_s(r.id, now)
            q = bisect_right(th, a)
            if q < len(th) and g:
                crossings.append(now + (th[q] - a) / g)
            if now - r.started_at < min_rt:
                cap -= g  # its minimum runtime: it keeps its GPUs
                pinned_until.append(r.started_at + min_rt)
                continue
            cands.append((q, r.first_submitted_at, r.id, r))
        for j in snapshot.queued:
            a = sim.attained_gpu_s(j.id, now)
            q = bisect_right(th, a)
            if self.starvation > 0 and q > 0:
                executed = a / max(1, j.gpu_count)
                if now - j.queued_at >= self.starvation * executed:
                    q = 0
            cands.append((q, j.first_submitted_at, j.id, j))
        cands.sort(key=lambda c: (c[0], c[1], c[2]))
        granted: set[int] = set()
        for _q, _t, jid, obj in cands:
            g = obj.gpu_count  # type: ignore[attr-defined]
            if g <= cap:
                granted.add(jid)
                cap -= g
        queued_ids = {j.id for j in snapshot.queued}
        for q, _t, jid, obj in cands:
            if jid not in queued_ids and jid not in granted:
                d.suspends.append(
                    Suspend(
                        jid,
                        f"las: attained-service queue {q}; jobs with less attained service need its GPUs",
                        code=SuspendCode.TIME_SHARING,
                    )
                )
        index = FreeIndex(n for n in snapshot.nodes if n.schedulable)
        index.fill({})
        waiting = False
        for q, _t, jid, obj in cands:
            if jid not in queued_ids:
                continue
            if jid not in granted:
                d.pending_reasons[jid] = f"las: queue {q}; the GPUs go to jobs with less attained service"
                waiting = True
                continue
            got = place(index, obj)  # type: ignore[arg-type]
            if got is None:
                d.pending_reasons[jid] = f"las: queue {q}; granted, waiting for its GPUs to be freed"
                continue
            d.starts.append(Start(jid, got[0], "las: " + got[1]))
        # when a rule can change its mind: a running job crosses a threshold or ends its
        # minimum runtime (only matters while someone waits)
        wake = None
        if waiting or d.pending_reasons:
            times = [t for t in crossings + pinned_until if t > now]
            wake = min(times) if times else None
        self.next_wakeup = wake
        return d
