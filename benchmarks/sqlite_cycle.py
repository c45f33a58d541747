"""The scheduler's cycle on SQLite (``hai dev``) with a deep queue: CPU per cycle, with the queue
kept across cycles (services/scheduling.QueueCache, what ``hai dev`` and ``hai scheduler`` do on
SQLite) and without it (every cycle reads every queued job, as before issue 12's change marker).

    python benchmarks/sqlite_cycle.py [--queued 10000] [--repeat 20]

The database is api_load.py's: ``--queued`` 1-GPU jobs of 20 users queued, 4 nodes of 8 GPUs with
fresh heartbeats, in a temporary SQLite file. Three cycles settle it (the first starts 32 jobs and
writes every queued job's pending reason; the next reads those rows again), then ``--repeat``
steady cycles each way, alternating, timed with ``time.process_time`` (the SQLite library's work is
in-process; CPU, not wall-clock, because the VM is shared). Prints JSON with the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))

import api_load  # noqa: E402
from sqlalchemy import update  # noqa: E402

from hai.db.base import utcnow  # noqa: E402
from hai.db.models import Node  # noqa: E402
from hai.services import scheduling  # noqa: E402
from hai.services.context import Platform  # noqa: E402
from hai.services.leader import leadership  # noqa: E402
from hai.settings import Settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    out: dict = {"queued": args.queued, "load_before": api_load.loadavg()}
    with tempfile.TemporaryDirectory(prefix="hai-sqlite-cycle-") as tmp:
        settings = Settings(data_dir=Path(tmp))
        _token, _agent, users = api_load.seed_users(settings)
        api_load.seed_jobs(settings.database_url, users[1:], args.queued)
        api_load.seed_nodes(settings, 4)
        platform = Platform.from_settings(settings)
        queue = scheduling.QueueCache()
        try:
            with leadership(platform, stop=threading.Event()) as lease:

                def cycle(cache: scheduling.QueueCache | None) -> tuple[float, scheduling.CycleResult]:
                    with platform.sessions() as s:  # heartbeats stay fresh (not timed)
                        s.execute(update(Node).values(last_heartbeat_at=utcnow()))
                        s.commit()
                    c0 = time.process_time()
                    with platform.read_sessions() as reading, platform.sessions() as session:
                        if cache is None:
                            result = scheduling.run_cycle(session, settings=settings, lease=lease, read_session=reading)
                        else:
                            result = scheduling.run_cycle(session, settings=settings, lease=lease,
                                                          read_session=reading, queue=cache)
                    return (time.process_time() - c0) * 1000, result

                out["settle_ms"] = [round(cycle(queue)[0], 1) for _ in range(3)]
                with_cache, without = [], []
                for _ in range(args.repeat):
                    ms, r1 = cycle(queue)
                    with_cache.append(ms)
                    ms, r2 = cycle(None)
                    without.append(ms)
                    assert r1.considered == r2.considered  # the same queue either way
                out["considered"] = len(r1.considered)
                out["steady_cycle_cpu_ms_with_queue_cache"] = round(statistics.median(with_cache), 1)
                out["steady_cycle_cpu_ms_full_read"] = round(statistics.median(without), 1)
        finally:
            platform.close()
    out["load_after"] = api_load.loadavg()
    out["cpus"] = os.cpu_count()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
