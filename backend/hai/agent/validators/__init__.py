"""Node validators (issue 10): the catalogue of checks (catalogue.py), how they see the hardware
(probes.py: NVML or fake GPUs; torch in a child process or fake figures) and the runner the agent
uses: ``Validator`` runs each requested run once, in its own thread, and keeps the finished
report until the server acknowledges it (a reply that no longer lists the run). From protocol
version 2 it also runs the node's periodic quick rounds when the agent asks (``own_round``):
their reports carry no run id and are dropped once a reply to a heartbeat that carried them came."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from hai.agent.faults import FaultPlan
from hai.agent.validators.catalogue import CATALOGUE, checks_for, run_check, run_suite
from hai.agent.validators.model import Check, Context, Skip, Thresholds, expected_for
from hai.agent.validators.probes import FakeBench, FakeProbe, NvmlProbe, TorchBench
from hai.protocol import GpuInfo, ValidationReport, ValidationRequest

__all__ = ["CATALOGUE", "Check", "Context", "Skip", "Thresholds", "Validator", "checks_for", "expected_for",
           "make_context", "run_check", "run_suite"]

log = logging.getLogger("hai.agent.validators")


def make_context(*, fake: bool, inventory: list[GpuInfo], checkpoint_root: str | Path, sysfs: str = "/sys",
                 faults: FaultPlan | None = None, busy_gpus: Callable[[], set[int]] | None = None) -> Context:
    thresholds = Thresholds.from_env()
    if fake:
        probe, bench = FakeProbe(inventory, faults), FakeBench(inventory, faults)
    else:
        probe, bench = NvmlProbe([g.index for g in inventory]), TorchBench(burn_s=thresholds.gemm_burn_s)
    return Context(probe=probe, bench=bench, inventory=list(inventory), checkpoint_root=Path(checkpoint_root),
                   sysfs=sysfs, busy_gpus=busy_gpus or (lambda: set()), thresholds=thresholds)


class Validator:
    def __init__(self, ctx: Context, *, on_done: Callable[[], None] | None = None, clock=time.time):  # noqa: ANN001
        self.ctx = ctx
        self.on_done = on_done or (lambda: None)
        self.clock = clock
        self._lock = threading.Lock()
        self._queue: deque[tuple[ValidationRequest, bool]] = deque()  # (request, an own round)
        self._seen: deque[int] = deque(maxlen=4096)  # run ids taken, never run twice
        self._done: dict[int, ValidationReport] = {}
        self._own: dict[float, ValidationReport] = {}  # own rounds' reports by their start
        self._thread: threading.Thread | None = None
        self.runs = 0

    def submit(self, requests: list[ValidationRequest]) -> None:
        with self._lock:
            for r in requests:
                if r.run_id in self._seen:
                    continue
                self._seen.append(r.run_id)
                self._queue.append((r, False))
            if self._queue and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._work, name="hai-agent-validate", daemon=True)
                self._thread.start()

    def own_round(self, expected: list[GpuInfo]) -> bool:
        """Start a periodic quick round of the agent's own (protocol version 2) unless a run is
        under way or waiting (True: started)."""
        with self._lock:
            if self._queue or (self._thread is not None and self._thread.is_alive()):
                return False
            self._queue.append((ValidationRequest(run_id=0, level="quick", expected_gpus=expected), True))
            self._thread = threading.Thread(target=self._work, name="hai-agent-validate", daemon=True)
            self._thread.start()
            return True

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                req, mine = self._queue.popleft()
            started = self.clock()
            name = "own periodic round" if mine else f"validation run {req.run_id}"
            (log.debug if mine else log.info)("%s (%s) starting", name, req.level)
            checks = run_suite(self.ctx, req.level, expected=req.expected_gpus)
            report = ValidationReport(run_id=None if mine else req.run_id, level=req.level, started_at=started,
                                      finished_at=self.clock(), checks=checks)
            failed = [c.name for c in checks if c.status == "failed"]
            if failed or not mine:  # a passed own round every few seconds is not worth a line
                log.info("%s finished: %s", name, f"failed {failed}" if failed else "passed")
            with self._lock:
                if mine:
                    self._own[started] = report
                else:
                    self._done[req.run_id] = report
                self.runs += 1
            self.on_done()

    def reports(self) -> list[ValidationReport]:
        with self._lock:
            return [self._done[k] for k in sorted(self._done)] + [self._own[k] for k in sorted(self._own)]

    def acknowledge(self, sent: list[ValidationReport], pending: list[ValidationRequest]) -> None:
        """A reply to a heartbeat that carried ``sent`` came: a requested run it no longer lists
        is delivered, and so is every own round it carried (the server stores each once)."""
        still = {r.run_id for r in pending}
        with self._lock:
            for report in sent:
                if report.run_id is None:
                    self._own.pop(report.started_at, None)
                elif report.run_id not in still:
                    self._done.pop(report.run_id, None)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._queue) or (self._thread is not None and self._thread.is_alive())
