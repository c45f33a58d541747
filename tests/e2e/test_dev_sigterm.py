"""`hai dev` stopped by a service manager: SIGTERM to its process alone (Ctrl-C signals the whole
process group, agents included; `kill` and systemd's stop signal only the main process)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.e2e.conftest import live_processes, start_stack, wait_for


def _agents_of(data_dir: Path) -> list[int]:
    """Live agent processes of this stack (by their ``--state-dir`` under its data dir)."""
    marker = str(data_dir.resolve() / "agents").encode()
    return [pid for pid, argv in live_processes("cmdline") if b"agent" in argv and any(a.startswith(marker) for a in argv)]


def test_sigterm_to_hai_dev_stops_its_agents_then_ends_it_by_the_signal(tmp_path):
    stack = start_stack(tmp_path, agents=2)
    try:
        assert len(_agents_of(stack.data_dir)) == 2
        stack.proc.send_signal(signal.SIGTERM)  # to hai dev alone, not to its group
        # uvicorn's graceful shutdown, the agents stopped and waited for, then the signal again
        assert stack.proc.wait(90) == -signal.SIGTERM
        # (hai dev waited for its agents before it ended: none is left, not even one ending)
        assert _agents_of(stack.data_dir) == []
        log = (tmp_path / "dev.log").read_text()
        assert "agent node-01 stopped" in log and "agent node-02 stopped" in log, log[-3000:]
    finally:
        for pid in _agents_of(stack.data_dir):  # (only when the test failed: no orphan left behind)
            os.kill(pid, signal.SIGKILL)
        if stack.proc.poll() is None:
            os.killpg(stack.proc.pid, signal.SIGKILL)
            stack.proc.wait(10)
        wait_for(lambda: not _agents_of(stack.data_dir), timeout=30, what="no agent of this stack left")
