"""examples/haiscale_ddp.py under the agent: a 2-rank torch DDP job (gloo, CPU) is suspended at a
checkpoint, resumed from it as a new attempt, and ends with exactly the step count and the
parameters of an uninterrupted run started by hand."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hai.agent.gpu import FakeGpus  # noqa: E402
from hai.agent.node import NodeAgent  # noqa: E402
from hai.agent.testing import assignment, wait_for  # noqa: E402
from hai.protocol import DesiredAction  # noqa: E402

PY = sys.executable
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "haiscale_ddp.py")
STEPS = 60
ARGS = ["--steps", str(STEPS), "--log-every", "5", "--hidden", "32", "--batch-size", "16"]
FINAL = re.compile(r"final step=(\d+) checksum=([0-9a-f]+)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_hand(tmp_path) -> tuple[int, str]:
    """Two processes with the torch.distributed environment, outside the platform."""
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAI_")}
    procs = []
    for rank in (0, 1):
        e = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([PY, EXAMPLE, *ARGS, "--ckpt-dir", str(tmp_path / "hand")], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    if [p.returncode for p in procs] != [0, 0]:  # the whole output (an assertion's would be cut short)
        pytest.fail(f"exit codes {[p.returncode for p in procs]}\n" + "\n".join(
            f"--- rank {r} ---\n{out}" for r, out in enumerate(outs)), pytrace=False)
    m = FINAL.search(outs[0])
    assert m, outs[0]
    return int(m.group(1)), m.group(2)


def test_suspend_and_resume_give_exactly_the_uninterrupted_result(tmp_path):
    ref_step, ref_sum = _by_hand(tmp_path)
    assert ref_step == STEPS

    node = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(2, node="n1"), kill_grace_s=5)

    def status(attempt):
        return next(s for s in node.statuses() if (s.job_id, s.attempt) == (1, attempt))

    # attempt 1: runs slowly enough to be caught in the middle, then is asked to suspend
    cmd = [PY, EXAMPLE, *ARGS, "--step-sleep", "0.1"]
    first = assignment(1, cmd, attempt=1, job_type="torch", gpus=[0, 1], master_port=_port(), suspend_grace_s=60)
    node.apply([first])
    wait_for(lambda: (lambda p: p and p.step >= 10)(status(1).progress), timeout=120, step=node.tick,
             what="training progress")
    node.apply([first.model_copy(update={"action": DesiredAction.SUSPEND})])
    wait_for(lambda: status(1).finished, timeout=120, step=node.tick, what="suspension")
    st = status(1)
    assert st.suspend_ready and st.stop_cause in (None, "suspend"), st
    ck = st.checkpoint
    assert ck is not None and 10 <= ck.step < STEPS and os.path.exists(ck.path)
    assert ck.path.startswith(str(node.checkpoint_dir(1)))  # HAI_CHECKPOINT_DIR
    out1 = node.attempts[(1, 1)].rank_path(0, "stdout").read_text()
    assert f"suspended at step {ck.step}" in out1 and "final step" not in out1

    # attempt 2: a resume from the reported checkpoint, without the slow-down
    node.apply([])
    second = assignment(1, [PY, EXAMPLE, *ARGS], attempt=2, job_type="torch", gpus=[0, 1], master_port=_port(),
                        resume_from=ck.path, restart_count=1)
    node.apply([second])
    wait_for(lambda: status(2).finished, timeout=180, step=node.tick, what="the resumed run")
    st2 = status(2)
    out2 = node.attempts[(1, 2)].rank_path(0, "stdout").read_text()
    if [r.exit_code for r in st2.ranks] != [0, 0]:
        pytest.fail(f"{st2}\n--- rank 0 stdout ---\n{out2}\n" + "\n".join(
            f"--- rank {r} stderr ---\n{node.attempts[(1, 2)].rank_path(r, 'stderr').read_text()}" for r in (0, 1)),
            pytrace=False)
    assert f"resumed from {ck.path} at step {ck.step}" in out2
    m = FINAL.search(out2)
    assert m and (int(m.group(1)), m.group(2)) == (ref_step, ref_sum)
    assert st2.progress.step == STEPS
    first_step_at = float(re.search(r"first step done at ([0-9.]+)", out2).group(1))
    print(f"\nsuspend request -> ranks gone: {st.finished_at - st.suspend_requested_at:.2f}s; "
          f"resume launch -> first step: {first_step_at - st2.started_at:.2f}s")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


THROUGHPUT = re.compile(r"throughput samples/s=([0-9.]+)")
BIG = ["--steps", "400", "--dim", "1024", "--hidden", "4096", "--layers", "6", "--batch-size", "256",
       "--log-every", "100", "--warmup", "50"]


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_over_nccl_under_the_agent_with_nvml(tmp_path):
    """On a GPU host: the same 2-rank NCCL training by hand and under the agent (NVML GPUs):
    same result, throughput within a few percent, and NVML shows the job's GPUs busy."""
    from hai.agent.gpu import NvmlGpus

    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAI_")}
    procs = [subprocess.Popen([PY, EXAMPLE, *BIG, "--ckpt-dir", str(tmp_path / "hand")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    hand_sps = float(THROUGHPUT.search(outs[0]).group(1))
    hand_final = FINAL.search(outs[0]).groups()

    gpus = NvmlGpus()
    node = NodeAgent(node="gpu", state_dir=tmp_path / "state", gpus=gpus, kill_grace_s=5)
    assert len(node.gpu_inventory) >= 2 and all(g.uuid.startswith("GPU-") for g in node.gpu_inventory)
    node.apply([assignment(1, [PY, EXAMPLE, *BIG], attempt=1, job_type="torch", gpus=[0, 1], master_port=_port())])
    peak = {0: 0.0, 1: 0.0}

    def sample():
        node.tick()
        for m in node.gpu_metrics():
            if m.index in peak:
                peak[m.index] = max(peak[m.index], m.util_pct)

    st = wait_for(lambda: (lambda s: s if s.finished else None)(node.statuses()[0]), timeout=300, interval=0.2,
                  step=sample, what="the GPU run")
    out = node.attempts[(1, 1)].rank_path(0, "stdout").read_text()
    assert [r.exit_code for r in st.ranks] == [0, 0], out + node.attempts[(1, 1)].rank_path(0, "stderr").read_text()
    agent_sps = float(THROUGHPUT.search(out).group(1))
    print(f"\nGPU throughput samples/s: by hand {hand_sps:.0f}, under the agent {agent_sps:.0f} "
          f"({100 * agent_sps / hand_sps:.1f}%); NVML peak util {peak}")
    assert FINAL.search(out).groups() == hand_final
    assert peak[0] > 0 and peak[1] > 0
    assert agent_sps >= 0.9 * hand_sps
    gpus.close()
