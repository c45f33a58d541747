"""The scheduler process's loop: lead (fenced: a lease whose epoch each new leader bumps), then
cycle after wake-ups and at least every ``scheduler.interval_s``. Wake-ups coalesce: one that
arrives less than ``scheduler.coalesce_s`` after the last cycle started waits for that much, so a
burst of N submissions costs about burst/coalesce_s cycles, not N, and a job waits at most
coalesce_s plus one cycle before one considers it (issue 12). A slow cycle is followed by a rest
in proportion (``scheduler.max_busy_share``), so cycles over a deep queue do not run back to back.
Also reaps silent nodes, fenced by the same lease (services/reaper.py; Celery beat reaps too, with
conditional writes)."""

from __future__ import annotations

import logging
import threading
import time

from hai.services import notify, queued_counts, reaper
from hai.services.context import Platform
from hai.services.leader import Fenced, Lease, NotLeader, leadership
from hai.services.scheduling import CycleResult, QueueCache, run_cycle

log = logging.getLogger(__name__)


def wake_delay(*, since_start_s: float, cycle_s: float, coalesce_s: float, busy_share: float) -> float:
    """How long a wake-up waits before the next cycle: until ``coalesce_s`` after the last cycle
    began (a burst of wake-ups shares one cycle), and until the scheduler has been busy at most
    ``busy_share`` of the time since then (a cycle of ``cycle_s`` is followed by at least
    ``cycle_s x (1/busy_share - 1)`` of rest). Issue 12: with 10,000 queued jobs the cycles ran back to
    back, and on SQLite (one process) they took the API's interpreter."""
    spacing = cycle_s / busy_share if busy_share < 1 else 0.0
    return max(coalesce_s, spacing) - since_start_s


class SchedulerLoop:
    def __init__(self, platform: Platform, *, stop: threading.Event | None = None) -> None:
        self.platform = platform
        self.stop = stop or threading.Event()
        self.cycles = 0
        self.leading = threading.Event()
        self.lease: Lease | None = None
        # notified after every cycle (tests and benchmarks wait on it instead of sleeping)
        self.cycle_done = threading.Condition()
        self.last_result: CycleResult | None = None
        self.queue = QueueCache()  # the queue kept across cycles
        self.folding = queued_counts.Folding()  # each user's queued-jobs rows folded into one now and then

    def run(self) -> None:
        """Lead, cycle; when fenced off (another leader took over), wait to lead again."""
        while not self.stop.is_set():
            try:
                with leadership(self.platform, stop=self.stop) as lease:
                    self.lease = lease
                    self.leading.set()
                    self._loop(lease)
            except Fenced as exc:
                log.warning("scheduler: fenced off, no longer leading: %s", exc)
            except NotLeader as exc:
                if not self.stop.is_set():
                    log.warning("scheduler: lost leadership: %s", exc)
            except Exception:
                log.exception("scheduler: leadership failed; trying again")
                self.stop.wait(1.0)
            finally:
                self.leading.clear()
                self.lease = None

    def _loop(self, lease: Lease | None = None) -> None:
        interval = min(self.platform.settings.scheduler.interval_s, self.platform.settings.scheduler.lease_s / 3)
        coalesce = self.platform.settings.scheduler.coalesce_s
        busy_share = self.platform.settings.scheduler.max_busy_share
        notifier = self.platform.notifier
        while not self.stop.is_set():
            since = notifier.version(notify.SCHEDULER)
            t0 = time.perf_counter()
            if lease is not None and not lease.alive():
                raise NotLeader(f"the liveness lock of epoch {lease.epoch} is gone (its connection dropped)")
            result = None
            try:
                result = self.cycle_once(lease)
            except Fenced:
                raise
            except Exception:
                log.exception("scheduling cycle failed; retrying")
            try:
                self.folding.maybe(self.platform.sessions, self.platform.read_sessions)
            except Exception:
                log.exception("folding the queued-jobs counts failed; trying again after the next cycle")
            with self.cycle_done:
                self.cycles += 1
                self.last_result = result
                self.cycle_done.notify_all()
            log.debug("cycle %d took %.1f ms", self.cycles, (time.perf_counter() - t0) * 1000)
            if self.stop.is_set():
                break
            t1 = time.perf_counter()
            if notifier.wait(notify.SCHEDULER, since, interval):
                now = time.perf_counter()
                rest = wake_delay(since_start_s=now - t0, cycle_s=t1 - t0, coalesce_s=coalesce, busy_share=busy_share)
                if rest > 0 and self.stop.wait(rest):
                    break

    def cycle_once(self, lease: Lease | None = None) -> CycleResult:
        settings = self.platform.settings
        with self.platform.sessions() as session:
            reaper.mark_lost_nodes(session=session, settings=settings, lease=lease)
        # both read only the queued jobs changed since the last cycle (issue 12); whatever goes
        # wrong, the next cycle reads the whole queue
        if self.platform.read_sessions is self.platform.sessions:  # PostgreSQL: reads never block a writer
            with self.platform.sessions() as session:
                try:
                    return run_cycle(session, settings=settings, lease=lease, queue=self.queue)
                except BaseException:
                    self.queue.reset()
                    raise
        # SQLite: plan in a deferred read, hold the write lock only to write
        with self.platform.read_sessions() as reading, self.platform.sessions() as session:
            try:
                return run_cycle(session, settings=settings, lease=lease, read_session=reading, queue=self.queue)
            except BaseException:
                self.queue.reset()
                raise

    def start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name="hai-scheduler", daemon=True)
        t.start()
        return t
