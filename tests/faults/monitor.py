"""The invariant monitor (issue 13): reads the database continuously (a thread, its own
connections, riding out the database's outages) and, at the end, checks what must hold through
every fault:

- every accepted submission (201) exists and reaches exactly one terminal state;
- no attempt of a job runs twice at once: never two active allocations of one (job, attempt,
  node rank);
- no GPU is held by two active allocations at any moment;
- a job ends ``failed`` only by its own exit code, its watchdog or its runtime limit (the job
  ids the harness expects to fail, with their exit codes);
- every suspension resumes from the last reported checkpoint: the monitor records each
  checkpoint the platform holds for a job (``jobs.last_checkpoint``) as it appears; an attempt
  (the job's own start mark) resumes from the last one recorded before it started — a checkpoint
  a job wrote while its agent was cut off never reached the platform, and does not count;
- no two copies of a job's rank 0 run at the same time (the jobs' start/tick/stop marks: each
  copy's interval is from its start to its last mark).

Used by tests/faults and benchmarks/chaos.py.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import create_engine, text

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Report:
    samples: int = 0
    sample_errors: int = 0  # database away while sampling
    gpu_conflicts: list[str] = field(default_factory=list)
    attempt_conflicts: list[str] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    not_terminal: list[str] = field(default_factory=list)
    terminal_twice: list[str] = field(default_factory=list)
    false_failures: list[str] = field(default_factory=list)
    bad_resumes: list[str] = field(default_factory=list)
    rank0_overlaps: list[str] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)

    @property
    def violations(self) -> dict[str, list]:
        return {k: v for k, v in {
            "gpu_conflicts": self.gpu_conflicts, "attempt_conflicts": self.attempt_conflicts, "lost": self.lost,
            "not_terminal": self.not_terminal, "terminal_twice": self.terminal_twice,
            "false_failures": self.false_failures, "bad_resumes": self.bad_resumes,
            "rank0_overlaps": self.rank0_overlaps}.items() if v}

    def assert_ok(self) -> None:
        assert not self.violations, self.violations


class InvariantMonitor:
    def __init__(self, db_url: str, *, period_s: float = 0.25) -> None:
        self.engine = create_engine(db_url, pool_pre_ping=True, pool_size=2,
                                    connect_args={"connect_timeout": 3})
        self.period_s = period_s
        self.report = Report()
        self.checkpoints: dict[int, list[tuple[float, str]]] = defaultdict(list)  # job -> (first seen, path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="invariant-monitor", daemon=True)

    def __enter__(self) -> "InvariantMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # the database is away (a fault under test): sample again later
                self.report.sample_errors += 1
            self._stop.wait(self.period_s)

    def sample(self) -> None:
        """One reading: every active allocation, in one statement (one consistent snapshot)."""
        with self.engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT job_id, attempt, node_name, node_rank, gpus FROM job_allocations WHERE active")).all()
            ckpts = conn.execute(text(
                "SELECT id, last_checkpoint FROM jobs WHERE last_checkpoint IS NOT NULL "
                "AND state NOT IN ('succeeded', 'failed', 'cancelled')")).all()
        now = time.time()
        for job_id, ck in ckpts:
            path = (ck or {}).get("path")
            seen = self.checkpoints[job_id]
            if path and (not seen or seen[-1][1] != path):
                seen.append((now, path))
        held: dict[tuple[str, int], list] = defaultdict(list)
        slots: dict[tuple[int, int, int], list] = defaultdict(list)
        for job_id, attempt, node, node_rank, gpus in rows:
            for g in gpus or []:
                held[(node, int(g))].append((job_id, attempt))
            slots[(job_id, attempt, node_rank)].append(node)
        self.report.samples += 1
        for (node, g), who in held.items():
            if len(who) > 1:
                self.report.gpu_conflicts.append(f"{time.time():.2f} GPU {g} of {node} held by {who}")
        for (job_id, attempt, node_rank), nodes in slots.items():
            if len(nodes) > 1:
                self.report.attempt_conflicts.append(
                    f"{time.time():.2f} job {job_id} attempt {attempt} node rank {node_rank} on {nodes}")

    # ------------------------------------------------------------------ the end

    def final(self, *, accepted: list[int], expected_exit: dict[int, int], marks: list[dict]) -> Report:
        self.stop()
        self.sample()
        r = self.report
        with self.engine.connect() as conn:
            jobs = {row[0]: row for row in conn.execute(text("SELECT id, state, exit_code FROM jobs")).all()}
            ends = defaultdict(int)
            for job_id, n in conn.execute(text(
                    "SELECT job_id, count(*) FROM job_events WHERE to_state IN ('succeeded','failed','cancelled') "
                    "GROUP BY job_id")).all():
                ends[job_id] = n
            fail_reasons = dict(conn.execute(text(
                "SELECT job_id, reason FROM job_events WHERE to_state = 'failed'")).all())
        states: dict[str, int] = defaultdict(int)
        for job_id in accepted:
            row = jobs.get(job_id)
            if row is None:
                r.lost.append(job_id)
                continue
            _, state, exit_code = row
            states[state] += 1
            if state not in TERMINAL:
                r.not_terminal.append(f"job {job_id}: {state}")
            if ends[job_id] != 1:
                r.terminal_twice.append(f"job {job_id}: {ends[job_id]} terminal events")
            want = expected_exit.get(job_id, 0)
            if state == "failed" and (want == 0 or exit_code != want):
                r.false_failures.append(f"job {job_id} failed (exit {exit_code}, expected {want}): "
                                        f"{fail_reasons.get(job_id, '')}")
            if state == "succeeded" and want != 0:
                r.false_failures.append(f"job {job_id} succeeded but its command exits {want}")
        r.states = dict(states)
        if len(set(accepted)) != len(accepted):
            r.terminal_twice.append("an accepted submission was answered with the id of another")
        r.bad_resumes.extend(check_resumes(marks, self.checkpoints))
        r.rank0_overlaps.extend(rank0_overlaps(marks))
        self.engine.dispose()
        return r


def check_resumes(marks: list[dict], observed: dict[int, list[tuple[float, str]]]) -> list[str]:
    """Each attempt's start resumes from the last checkpoint the platform held for the job
    before it started (``observed``: the checkpoints the monitor saw appear, in order). A
    checkpoint the job wrote but the platform never learned of is not one (the agent was cut
    off). Sampling may miss a checkpoint that came and went between two readings: the resume
    must then be one the job reported, and no older than the last one seen."""
    bad = []
    reported = {(m["job"], m["path"]) for m in marks if m["ev"] == "ckpt"}
    for m in marks:
        if m["ev"] != "start" or m["rank"] != 0 or m["attempt"] <= 1:
            continue
        job, got = m["job"], m.get("resume_from")
        before = [p for t, p in observed.get(job, []) if t < m["t"]]
        seen = [p for _, p in observed.get(job, [])]
        if not before:
            if got is not None and (job, got) not in reported:
                bad.append(f"job {job} attempt {m['attempt']} resumed from {got}, which it never wrote")
            continue
        want = before[-1]
        if got == want:
            continue
        if got is None or (job, got) not in reported or (got in seen and seen.index(got) < seen.index(want)):
            bad.append(f"job {job} attempt {m['attempt']} resumed from {got}, last checkpoint {want}")
    return bad


def rank0_overlaps(marks: list[dict]) -> list[str]:
    """Two copies (distinct node/pid) of one job's rank 0 whose [start, last mark] intervals
    intersect."""
    spans: dict[tuple[int, str, int], list[float]] = {}
    for m in marks:
        if m["rank"] != 0:
            continue
        key = (m["job"], m["node"], m["pid"])
        span = spans.setdefault(key, [m["t"], m["t"]])
        span[0] = min(span[0], m["t"])
        span[1] = max(span[1], m["t"])
    by_job: dict[int, list] = defaultdict(list)
    for (job, node, pid), (a, b) in spans.items():
        by_job[job].append((a, b, node, pid))
    out = []
    for job, copies in by_job.items():
        copies.sort()
        for (a1, b1, n1, p1), (a2, b2, n2, p2) in zip(copies, copies[1:]):
            if a2 < b1:
                out.append(f"job {job}: rank 0 ran on {n1} (pid {p1}) until {b1:.2f} and on {n2} (pid {p2}) "
                           f"from {a2:.2f}")
    return out
