"""Baseline ``--policy las``: Tiresias' discretised two-dimensional least-attained-service
(Gu et al., NSDI'19, "Tiresias: A GPU Cluster Manager for Distributed Deep Learning"), restated
on our snapshot from its released simulator (github.com/SymbioticLab/Tiresias, commit 959f9b0,
``simulator/run_sim.py``: ``dlas_sim_jobs(gputime=True, solve_starvation=0)``, which is what
``--schedule=dlas-gpu`` runs; ``simulator/jobs.py``: the queues and their limits).

What the released simulator does, and this module with it:

* Attained service is GPU-time: ``j_gt = executed_time * num_gpu`` (``gputime=True``). It is
  duration-blind.
* Queues: ``num_queue = 3`` with ``queue_limit = [3250, 7200, 18000]``; a job in queue q below
  the last is demoted to q+1 once ``j_gt >= queue_limit[q]``, so the thresholds in force are
  3,250 and 7,200 GPU-seconds (``DEFAULT_THRESHOLDS``; the 18,000 is never read). Demotion is
  one queue at a time, at the moment the threshold is crossed (its ``next_job_jump`` events).
* New jobs are appended to queue 0; a demoted job is appended to the end of its new queue.
* Each event, the queues are walked in order, each queue front to back; a job is granted its
  GPUs while the cluster's free GPU count lasts (``CLUSTER.free_gpu >= job['num_gpu']``, the
  ``count`` scheme); a running job not granted is preempted, a pending job granted starts.
* After each round every pending job is moved to the back of its queue, keeping their order:
  within a queue the running jobs stay ahead of the waiting ones, so a job is preempted only
  by a job of a *higher* (less attained) queue, never by one of its own queue. (Without this
  rule FIFO-by-submission inside a queue makes equal-queue jobs preempt each other on every
  event: that was this baseline's thrashing, 10% of GPU time lost.)
* Starvation knob ``solve_starvation`` (off, 0, in ``dlas-gpu``; ``dlas-gpu-1/2/4/8/...`` set it):
  a pending job in a queue above 0 that has waited ``starvation x executed_time`` since it last
  ran is moved back to queue 0 and its ``executed_time`` reset (its demotion counter restarts;
  its total progress does not). ``LasScheduler(starvation=...)``.

What it shares with ours, so only the policy differs: the placement rules
(``baseline_common.place``: a granted job starts where it fits on one zone, multi-node jobs on
the fewest leaves; Tiresias' ``count`` scheme ignores fragmentation, here a granted job that
does not fit waits), the simulator's checkpoint and restart costs (a suspension loses the
progress since the last checkpoint, costs ``checkpoint_cost_s`` and a restart
``restart_cost_s``; Tiresias' simulator charges nothing) and the minimum runtime: a job that
has run less than the policy's ``min_runtime_s`` in its attempt is not preempted (it keeps its
GPUs, counted first).
"""

from __future__ import annotations

from bisect import bisect_right

from hai.domain.jobs import JobState
from hai.domain.scheduler.model import Decisions, Policy, RunningJob, Snapshot, Start, Suspend, SuspendCode
from hai.domain.scheduler.placement import FreeIndex
from hai.sim.baseline_common import Baseline, place

DEFAULT_THRESHOLDS = (3250.0, 7200.0)  # Tiresias jobs.py queue_limit[:num_queue - 1]
REASONS = 100  # pending reasons for the first waiting jobs only (the simulator reads none)


class LasScheduler(Baseline):
    def __init__(self, thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS, starvation: float = 0.0):
        super().__init__()
        self.thresholds = tuple(sorted(thresholds))
        self.starvation = starvation
        self.queues: list[list[int]] = [[] for _ in range(len(self.thresholds) + 1)]
        self.qid: dict[int, int] = {}  # job id -> its queue
        self.base: dict[int, float] = {}  # job id -> attained service when its executed_time was last reset
        self.pending_s: dict[int, float] = {}  # job id -> Tiresias' last_pending_time (since its last reset)
        self.last_call: float | None = None

    def queue_of(self, executed_gpu_s: float) -> int:
        """The queue a job with this much executed GPU-time has reached (demotion only)."""
        return bisect_right(self.thresholds, executed_gpu_s)

    def __call__(self, snapshot: Snapshot, policy: Policy, now: float) -> Decisions:
        th, queues, qid, base = self.thresholds, self.queues, self.qid, self.base
        last = len(th)
        d = Decisions()
        min_rt = policy.min_runtime_s
        jobs: dict[int, object] = {r.id: r for r in snapshot.running}
        queued_ids = {j.id for j in snapshot.queued}
        jobs.update((j.id, j) for j in snapshot.queued)
        running: dict[int, RunningJob] = {r.id: r for r in snapshot.running if r.state != JobState.SUSPENDING}
        # forget finished jobs; append new ones to queue 0 in order of arrival
        if len(qid) + sum(1 for jid in jobs if jid not in qid) != len(jobs):
            gone = {jid for jid in qid if jid not in jobs}
            for q in queues:
                q[:] = [jid for jid in q if jid not in gone]
            for jid in gone:
                del qid[jid]
                base.pop(jid, None)
                self.pending_s.pop(jid, None)
        new = [o for jid, o in jobs.items() if jid not in qid]
        if new:
            new.sort(key=lambda o: (o.first_submitted_at, o.id))  # type: ignore[attr-defined]
            for o in new:
                qid[o.id] = 0  # type: ignore[attr-defined]
                base[o.id] = o.attained_gpu_s  # type: ignore[attr-defined]
                queues[0].append(o.id)  # type: ignore[attr-defined]
        # executed GPU-time since the last reset (Tiresias' executed_time * num_gpu): a running
        # job's grows, a waiting job's does not
        executed: dict[int, float] = {}
        for jid, r in running.items():
            executed[jid] = r.attained_gpu_s + max(0.0, now - r.started_at) * _gpus(r) - base[jid]
        # demotion (one queue at a time, as each threshold is crossed)
        for jid, e in executed.items():
            q = qid[jid]
            if q < last and e >= th[q]:
                queues[q].remove(jid)
                qid[jid] = q + 1
                queues[q + 1].append(jid)
        # promotion of starved jobs (the knob; Tiresias counts a job's pending time only once it ran)
        if self.starvation > 0:
            dt = 0.0 if self.last_call is None else now - self.last_call
            pending_s = self.pending_s
            for q in range(1, last + 1):
                keep = []
                for jid in queues[q]:
                    if jid not in running:
                        o = jobs[jid]
                        e = o.attained_gpu_s - base[jid]  # type: ignore[attr-defined]
                        if e > 0:
                            p = pending_s[jid] = pending_s.get(jid, 0.0) + dt
                            if p >= self.starvation * e / max(1, _gpus(o)):  # type: ignore[attr-defined]
                                base[jid] += e
                                pending_s[jid] = 0.0
                                qid[jid] = 0
                                queues[0].append(jid)
                                continue
                    keep.append(jid)
                queues[q] = keep
        self.last_call = now
        # the round: queues in order, front to back, while the free GPU count lasts
        cap = sum(n.gpus for n in snapshot.nodes if n.schedulable)
        pinned: set[int] = set()
        pinned_until: list[float] = []
        for r in snapshot.running:
            if r.state == JobState.SUSPENDING:
                cap -= _gpus(r)
                pinned.add(r.id)
            elif now - r.started_at < min_rt:
                cap -= _gpus(r)  # in its minimum runtime: it keeps its GPUs
                pinned.add(r.id)
                pinned_until.append(r.started_at + min_rt)
        index = FreeIndex(n for n in snapshot.nodes if n.schedulable)
        index.fill({})
        granted: set[int] = set()
        started: set[int] = set()
        reasons = 0
        ahead = 0
        for qn, q in enumerate(queues):
            if cap <= 0:
                break
            for jid in q:
                if cap <= 0:
                    break
                ahead += 1
                if jid in pinned:
                    continue
                o = jobs[jid]
                g = _gpus(o)
                if g > cap:
                    if jid in queued_ids:
                        if reasons < REASONS:
                            reasons += 1
                            d.pending_reasons[jid] = (
                                f"las: queue {qn}; waits behind {ahead - 1} job(s) with less attained service or"
                                " ahead of it in its queue"
                            )
                    continue
                cap -= g
                granted.add(jid)
                if jid in running:
                    continue
                got = place(index, o)  # type: ignore[arg-type]
                if got is None:
                    d.pending_reasons[jid] = f"las: queue {qn}; granted, waiting for its GPUs to be freed"
                    continue
                started.add(jid)
                d.starts.append(Start(jid, got[0], "las: " + got[1]))
        waiting = len(started) < len(queued_ids)
        for jid in running:
            if jid not in granted and jid not in pinned:
                d.suspends.append(
                    Suspend(
                        jid,
                        f"las: queue {qid[jid]} after {executed[jid] / 3600:.1f} GPU-hours; jobs in a queue"
                        " with less attained service need its GPUs",
                        code=SuspendCode.TIME_SHARING,
                    )
                )
        # pending jobs to the back of their queues (running ones stay ahead, in order)
        still = set(running).difference(s.job_id for s in d.suspends)
        still |= started
        for q in queues:
            if q:
                q[:] = [jid for jid in q if jid in still] + [jid for jid in q if jid not in still]
        # when a rule can change its mind: a running job crosses its queue's limit or ends its
        # minimum runtime, a starved job is promoted (only matters while someone waits)
        wake = None
        if waiting:
            times = [t for t in pinned_until if t > now]
            for jid in still:
                q = qid[jid]
                if q < last:
                    g = _gpus(jobs[jid])
                    if g:
                        times.append(now + (th[q] - executed.get(jid, 0.0)) / g)
            if self.starvation > 0:
                for jid, o in jobs.items():
                    if jid not in still and qid[jid] > 0:
                        e = o.attained_gpu_s - base[jid]  # type: ignore[attr-defined]
                        if e > 0:
                            due = self.starvation * e / max(1, _gpus(o)) - self.pending_s.get(jid, 0.0)  # type: ignore[attr-defined]
                            times.append(now + max(due, 1.0))
            times = [t for t in times if t > now]
            wake = min(times) if times else None
        self.next_wakeup = wake
        return d


def _gpus(o: object) -> int:
    """GPUs a job holds or asks for (a running job holds whole shapes: nodes x GPUs per node)."""
    return o.nodes * o.gpus_per_node  # type: ignore[attr-defined]
