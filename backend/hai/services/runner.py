"""The scheduler process's loop: lead, then cycle after every wake-up and at least every
``scheduler.interval_s``. Also reaps silent nodes (idempotent; Celery beat does it too)."""

from __future__ import annotations

import logging
import threading
import time

from hai.services import notify, reaper
from hai.services.context import Platform
from hai.services.leader import NotLeader, leadership
from hai.services.scheduling import run_cycle

log = logging.getLogger(__name__)


class SchedulerLoop:
    def __init__(self, platform: Platform, *, stop: threading.Event | None = None) -> None:
        self.platform = platform
        self.stop = stop or threading.Event()
        self.cycles = 0
        self.leading = threading.Event()

    def run(self) -> None:
        try:
            with leadership(self.platform, stop=self.stop):
                self.leading.set()
                self._loop()
        except NotLeader:
            pass
        finally:
            self.leading.clear()

    def _loop(self) -> None:
        interval = self.platform.settings.scheduler.interval_s
        notifier = self.platform.notifier
        while not self.stop.is_set():
            since = notifier.version(notify.SCHEDULER)
            t0 = time.perf_counter()
            try:
                self.cycle_once()
            except Exception:
                log.exception("scheduling cycle failed; retrying")
            self.cycles += 1
            log.debug("cycle %d took %.1f ms", self.cycles, (time.perf_counter() - t0) * 1000)
            if self.stop.is_set():
                break
            notifier.wait(notify.SCHEDULER, since, interval)

    def cycle_once(self) -> None:
        settings = self.platform.settings
        with self.platform.sessions() as session:
            reaper.mark_lost_nodes(session=session, settings=settings)
        with self.platform.sessions() as session:
            run_cycle(session, settings=settings)

    def start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name="hai-scheduler", daemon=True)
        t.start()
        return t
