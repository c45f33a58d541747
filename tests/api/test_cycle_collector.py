"""Issue 12: the scheduler's cycle pauses Python's cyclic garbage collector from the snapshot's
read to the decisions' commit (not only for the domain's part): at 10,000 nodes, 20,000
running and 100,000 queued jobs the collections it set off walked every object the process
keeps and were ~40% of the read (benchmarks/sqlite_cycle.py). The caller's setting comes back
after the cycle, also when the cycle raises."""

from __future__ import annotations

import gc

import pytest

from hai.services import scheduling


def _run(api):  # noqa: ANN001, ANN202
    with api.platform.sessions() as s:
        return scheduling.run_cycle(s, settings=api.platform.settings)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_whole_cycle_runs_with_the_collector_paused_and_leaves_it_as_it_found_it(api, monkeypatch, enabled):
    api.register_node("n0")
    job = api.submit(gpus_per_node=1)
    seen: dict[str, bool] = {}
    for name in ("_load", "apply_decisions"):
        def spy(*a, _name=name, _real=getattr(scheduling, name), **k):  # noqa: ANN002, ANN003, ANN202
            seen[_name] = gc.isenabled()
            return _real(*a, **k)
        monkeypatch.setattr(scheduling, name, spy)
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        assert _run(api).started == [job["id"]]  # a real cycle: it read, decided and wrote
        assert seen == {"_load": False, "apply_decisions": False}
        assert gc.isenabled() is enabled

        def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError("the write failed")
        monkeypatch.setattr(scheduling, "apply_decisions", broken)
        api.submit(gpus_per_node=1)
        with pytest.raises(RuntimeError, match="the write failed"):
            _run(api)
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
