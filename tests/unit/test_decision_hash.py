"""The scheduler's decisions on 32 generated snapshots hash as recorded.

``benchmarks/decision_hash.py`` builds the cases (Fire-Flyer-shaped clusters packed by the
scheduler, queues of 300 and 2,500 jobs, four seeds, time-sharing on and off, preemption off, a
small per-cycle cap with cross-zone jobs, and a second cycle with reservations and suspensions
in progress) and hashes everything each cycle decides. A refactor that changes no decision keeps
every hash; a deliberate change of policy re-records them (``--record``) and says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import decision_hash  # noqa: E402


def test_every_case_decides_as_recorded():
    want = json.loads(decision_hash.RECORD.read_text())
    got = decision_hash.hashes()
    assert len(got) >= 16
    assert got.keys() == want.keys()
    assert [k for k in got if got[k] != want[k]] == []


def test_the_hash_sees_a_changed_reason():
    name, snap, pol, now = next(iter(decision_hash.cases()))
    d = decision_hash.schedule(snap, pol, now)
    before = decision_hash.digest(d)
    jid = next(iter(d.pending_reasons))
    d.pending_reasons[jid] += "."
    assert decision_hash.digest(d) != before
