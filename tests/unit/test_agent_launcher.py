"""Launch templates and the rank processes: environment per job type, process groups,
SIGTERM then SIGKILL, exit codes, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest

from hai.agent import launcher
from hai.agent.gpu import FakeGpus, discover_nics
from hai.agent.node import NodeAgent
from hai.agent.procs import group_members, is_alive, start_ticks
from hai.agent.testing import assignment, wait_for
from hai.protocol import GpuInfo, LaunchSpec, NicInfo

PY = sys.executable


def _spec(**kw) -> LaunchSpec:
    base = dict(job_name="train", user="alice", command=[PY, "train.py"], gpus=[2, 3], node_rank=1, nnodes=2,
                gpus_per_node=2, master_addr="10.1.2.3", master_port=29511, env={"FOO": "bar"})
    base.update(kw)
    return LaunchSpec(**base)


def _plan(spec, gpus=None, nics=(), sysfs="/nonexistent", base_env=None):
    gpus = gpus or [GpuInfo(index=i, uuid=f"GPU-{i}", model="X", memory_total_mib=1) for i in range(8)]
    return launcher.plan_ranks(spec, job_id=42, attempt=3, node="n1", node_gpus=gpus, nics=list(nics),
                               control_dir="/state/ctl", checkpoint_dir="/state/ckpt",
                               base_env=base_env if base_env is not None else {"PATH": "/usr/bin"},
                               sysfs=sysfs)


# ------------------------------------------------------------------ pure: environment per type


def test_command_jobs_run_one_process_per_node_with_all_the_gpus():
    (p,) = _plan(_spec(job_type="command", restart_count=2, resume_from="/ck/last.pt"))
    e = p.env
    assert (p.rank, p.local_rank, p.gpus) == (1, 0, [2, 3])
    assert e["RANK"] == "1" and e["LOCAL_RANK"] == "0" and e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "1"
    assert e["NODE_RANK"] == "1" and e["NNODES"] == "2"
    assert e["MASTER_ADDR"] == "10.1.2.3" and e["MASTER_PORT"] == "29511"
    assert e["CUDA_VISIBLE_DEVICES"] == "2,3" and e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert e["HAI_JOB_ID"] == "42" and e["HAI_ATTEMPT"] == "3" and e["HAI_RESTART_COUNT"] == "2"
    assert e["HAI_CHECKPOINT_DIR"] == "/state/ckpt" and e["HAI_CONTROL_DIR"] == "/state/ctl"
    assert e["HAI_RESUME_FROM"] == "/ck/last.pt"
    assert e["FOO"] == "bar" and e["PATH"] == "/usr/bin" and e["PYTHONUNBUFFERED"] == "1"
    assert p.argv == [PY, "train.py"]


def test_torch_jobs_run_one_process_per_gpu_with_the_distributed_environment():
    plans = _plan(_spec(job_type="torch"))
    assert [(p.rank, p.local_rank, p.gpus) for p in plans] == [(2, 0, [2]), (3, 1, [3])]
    for p in plans:
        e = p.env
        assert e["RANK"] == str(p.rank) and e["LOCAL_RANK"] == str(p.local_rank)
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2" and e["NODE_RANK"] == "1"
        assert e["CUDA_VISIBLE_DEVICES"] == str(p.gpus[0])
        assert "HAI_RESUME_FROM" not in e
        assert "HAI_NIC" not in e and "NCCL_IB_HCA" not in e and p.cpus is None


def test_hfreduce_binds_each_rank_to_its_gpus_numa_cpus_and_nic(tmp_path):
    sysfs = tmp_path / "sys"
    for node, cpus in ((0, "0"), (1, "1")):
        d = sysfs / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for nic, numa in (("mlx5_0", 0), ("mlx5_1", 1)):
        d = sysfs / "class" / "infiniband" / nic / "device"
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{numa}\n")
    nics = discover_nics(str(sysfs))
    assert nics == [NicInfo(name="mlx5_0", numa_node=0), NicInfo(name="mlx5_1", numa_node=1)]
    gpus = [GpuInfo(index=i, uuid=f"G{i}", model="X", memory_total_mib=1, numa_node=i // 4) for i in range(8)]
    plans = _plan(_spec(job_type="hfreduce", gpus=[3, 4]), gpus=gpus, nics=nics, sysfs=str(sysfs))
    allowed = os.sched_getaffinity(0)
    p3, p4 = plans
    assert p3.env["HAI_NIC"] == p3.env["NCCL_IB_HCA"] == "mlx5_0" and p3.env["HAI_NUMA_NODE"] == "0"
    assert p4.env["HAI_NIC"] == p4.env["NCCL_IB_HCA"] == "mlx5_1" and p4.env["HAI_NUMA_NODE"] == "1"
    assert p3.cpus == ([0] if 0 in allowed else None) and p4.cpus == ([1] if 1 in allowed else None)
    assert p3.env["RANK"] == "2" and p3.env["WORLD_SIZE"] == "4"


def test_hfreduce_without_topology_information_skips_binding_gracefully():
    plans = _plan(_spec(job_type="hfreduce"))
    assert all(p.cpus is None and "NCCL_IB_HCA" not in p.env for p in plans)


def test_the_agents_own_settings_and_distributed_env_never_reach_a_job():
    base = launcher.base_environment({"PATH": "/bin", "HAI_TOKEN": "secret", "HAI_DATABASE_URL": "x",
                                      "RANK": "5", "MASTER_PORT": "1", "HOME": "/root"})
    assert base == {"PATH": "/bin", "HOME": "/root"}


def test_the_platforms_variables_win_over_the_jobs_env():
    (p,) = _plan(_spec(job_type="command", env={"CUDA_VISIBLE_DEVICES": "7", "HAI_JOB_ID": "1", "X": "y",
                                                 "PYTHONUNBUFFERED": "0"}))
    assert p.env["CUDA_VISIBLE_DEVICES"] == "2,3" and p.env["HAI_JOB_ID"] == "42" and p.env["X"] == "y"
    assert p.env["PYTHONUNBUFFERED"] == "0"  # a default the job may change


@pytest.mark.parametrize("spec, msg", [
    (_spec(gpus=[9]), "do not exist"),
    (_spec(job_type="torch", gpus=[0], gpus_per_node=2), "gpus_per_node"),
    (_spec(job_type="torch", gpus=[], gpus_per_node=0), "at least one GPU"),
    (_spec(node_rank=2), "node_rank"),
])
def test_inconsistent_specs_are_launch_errors(spec, msg):
    with pytest.raises(launcher.LaunchError, match=msg):
        _plan(spec)


# ------------------------------------------------------------------ real processes


@pytest.fixture
def node(tmp_path):
    n = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(4, node="n1"), kill_grace_s=1.0)
    yield n
    n.stop_all()
    wait_for(lambda: not n.running(), timeout=15, step=n.tick, what="cleanup")


def _run(node, *assignments):
    node.apply(list(assignments))
    node.tick()


def _status(node, job_id, attempt=0):
    return next(s for s in node.statuses() if (s.job_id, s.attempt) == (job_id, attempt))


def _final(node, job_id, attempt=0):
    st = _status(node, job_id, attempt)
    return st if st.finished else None


def _finished(node, job_id, timeout=20.0):
    return wait_for(lambda: _final(node, job_id), timeout=timeout, step=node.tick, what=f"job {job_id} to finish")


def _script(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def test_each_rank_gets_its_environment_and_runs_as_its_own_process_group(node, tmp_path):
    s = _script(tmp_path, "env.py", """
        import json, os, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "HAI_JOB_ID", "HAI_CONTROL_DIR",
                "HAI_CHECKPOINT_DIR", "MASTER_PORT"]
        print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid(),
                          "pgid": os.getpgid(0), "sid": os.getsid(0), "ppid": os.getppid()}))
    """)
    _run(node, assignment(1, [PY, s], job_type="torch", gpus=[1, 3], master_port=29600))
    st = _finished(node, 1)
    assert [r.exit_code for r in st.ranks] == [0, 0]
    att = node.attempts[(1, 0)]
    for r in att.ranks:
        out = json.loads(att.rank_path(r.rank, "stdout").read_text())
        assert out["env"]["RANK"] == str(r.rank) and out["env"]["WORLD_SIZE"] == "2"
        assert out["env"]["CUDA_VISIBLE_DEVICES"] == str(r.gpus[0]) and out["env"]["HAI_JOB_ID"] == "1"
        assert out["env"]["HAI_CONTROL_DIR"] == str(att.control_dir)
        assert out["env"]["HAI_CHECKPOINT_DIR"] == str(node.checkpoint_dir(1))
        assert os.path.isdir(out["env"]["HAI_CHECKPOINT_DIR"])
        # the wrapper is the session and group leader; the command is its child, in its group
        assert out["ppid"] == r.pid and out["pgid"] == r.pid and out["sid"] == r.pid


def test_exit_codes_are_reported_per_rank(node, tmp_path):
    s = _script(tmp_path, "exit.py", "import os, sys; sys.exit(int(os.environ['RANK']) + 3)\n")
    _run(node, assignment(2, [PY, s], job_type="torch", gpus=[0]))
    st = _finished(node, 2)
    assert [(r.rank, r.state, r.exit_code) for r in st.ranks] == [(0, "exited", 3)]
    assert st.launch_error is None and st.stop_cause is None


def test_a_killed_rank_reports_128_plus_the_signal(node, tmp_path):
    s = _script(tmp_path, "kill.py", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)\n")
    _run(node, assignment(3, [PY, s]))
    assert _finished(node, 3).ranks[0].exit_code == 128 + signal.SIGSEGV


def test_a_missing_program_is_a_launch_error_and_nothing_runs(node, tmp_path):
    _run(node, assignment(4, ["/no/such/program", "x"]))
    st = _status(node, 4)
    assert st.finished and "not found" in st.launch_error and st.ranks == []
    _run(node, assignment(5, ["no-such-program-hai"]))
    assert "not found" in _status(node, 5).launch_error


def test_stop_sends_sigterm_to_the_group_then_sigkill_after_the_grace(node, tmp_path):
    # the command ignores SIGTERM and has a child (same group) that ignores it too
    ready = tmp_path / "ready"
    s = _script(tmp_path, "stubborn.py", f"""
        import signal, subprocess, sys, time, pathlib
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        print("child", child.pid, flush=True)
        pathlib.Path({str(ready)!r}).write_text(str(child.pid))
        time.sleep(600)
    """)
    _run(node, assignment(6, [PY, s], stop_grace_s=1.0))
    wait_for(ready.exists, step=node.tick, what="job start")
    child = int(ready.read_text())
    pgid = node.attempts[(6, 0)].ranks[0].pid
    t0 = time.monotonic()
    _run(node, assignment(6, [PY, s], action="stop", stop_grace_s=1.0))
    st = _status(node, 6)
    assert st.stop_cause == "requested" and not st.finished
    # SIGTERM alone does not end it
    assert is_alive(pgid, None)
    st = _finished(node, 6)
    assert time.monotonic() - t0 >= 1.0
    assert st.ranks[0].exit_code == 128 + signal.SIGKILL
    assert not is_alive(child, None) and group_members(pgid) == []


def test_sigterm_suffices_for_a_well_behaved_job(node, tmp_path):
    ready = tmp_path / "ready"
    s = _script(tmp_path, "polite.py", f"""
        import pathlib, time
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(600)
    """)
    _run(node, assignment(7, [PY, s], stop_grace_s=30.0))
    wait_for(ready.exists, step=node.tick, what="job start")
    t0 = time.monotonic()
    _run(node, assignment(7, [PY, s], action="stop"))
    st = _finished(node, 7)
    assert st.ranks[0].exit_code == 128 + signal.SIGTERM and time.monotonic() - t0 < 10


def test_nothing_is_left_behind_when_the_command_exits(node, tmp_path):
    """Background children in the group and daemonized grandchildren (new session) die with the rank."""
    pids = tmp_path / "pids"
    s = _script(tmp_path, "leaky.py", f"""
        import subprocess, sys, pathlib
        a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        pathlib.Path({str(pids)!r}).write_text(f"{{a.pid}} {{b.pid}}")
    """)
    _run(node, assignment(8, [PY, s]))
    st = _finished(node, 8)
    assert st.ranks[0].exit_code == 0
    a, b = (int(x) for x in pids.read_text().split())
    wait_for(lambda: not is_alive(a, None) and not is_alive(b, None), timeout=10, what="leftovers to die")


def test_a_failing_rank_stops_the_other_ranks_of_its_attempt(node, tmp_path):
    s = _script(tmp_path, "fail.py", """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(5)
        time.sleep(600)
    """)
    _run(node, assignment(9, [PY, s], job_type="torch", gpus=[0, 1]))
    st = _finished(node, 9)
    assert st.stop_cause == "rank_failed" and "rank 1 exited with code 5" in st.stopped_reason
    assert sorted((r.rank, r.exit_code) for r in st.ranks) == [(0, 128 + signal.SIGTERM), (1, 5)]


def test_max_runtime_is_enforced(node, tmp_path):
    s = _script(tmp_path, "long.py", "import time; time.sleep(600)\n")
    _run(node, assignment(10, [PY, s], max_runtime_s=0.5))
    st = _finished(node, 10)
    assert st.stop_cause == "max_runtime" and "max_runtime_s" in st.stopped_reason
    assert st.ranks[0].exit_code == 128 + signal.SIGTERM


def test_the_log_watchdog_stops_a_silent_job(node, tmp_path):
    s = _script(tmp_path, "quiet.py", "import time; print('one line', flush=True); time.sleep(600)\n")
    _run(node, assignment(11, [PY, s], log_watchdog_s=1.0))
    st = wait_for(lambda: _final(node, 11), step=lambda: (node.tick(), node.tail_logs()), what="watchdog")
    assert st.stop_cause == "log_watchdog" and "log_watchdog_s" in st.stopped_reason


def test_an_unassigned_attempt_is_stopped_and_forgotten_after_its_final_report(node, tmp_path):
    s = _script(tmp_path, "long.py", "import time; time.sleep(600)\n")
    _run(node, assignment(12, [PY, s]))
    wait_for(lambda: node.busy_gpus(), step=node.tick, what="start")
    node.apply([])
    st = _finished(node, 12)
    assert st.stop_cause == "unassigned"
    wait_for(lambda: node.attempts[(12, 0)].drained, step=node.tail_logs, what="logs drained")
    node.mark_reported(node.statuses())
    assert (12, 0) not in node.attempts
    # a stale reply assigning it again never launches it a second time; its final status is reported
    launches = node.launches
    _run(node, assignment(12, [PY, s]))
    assert node.launches == launches and not node.running()
    assert _status(node, 12).finished and _status(node, 12).stop_cause == "unassigned"


def test_run_is_idempotent(node, tmp_path):
    s = _script(tmp_path, "long.py", "import time; time.sleep(600)\n")
    a = assignment(13, [PY, s])
    for _ in range(5):
        _run(node, a)
    assert node.launches == 1 and len(node.attempts[(13, 0)].ranks) == 1


def test_stop_or_suspend_for_a_never_launched_attempt_reports_not_launched(node):
    _run(node, assignment(14, [PY, "-c", "pass"], action="stop"), assignment(15, [PY, "-c", "pass"], action="suspend"))
    for j in (14, 15):
        st = _status(node, j)
        assert st.finished and st.stop_cause == "not_launched" and st.ranks == []
    _run(node, assignment(14, [PY, "-c", "pass"]))  # a late 'run' cannot launch it any more
    assert node.launches == 0


def test_a_new_attempt_waits_until_the_previous_one_released_its_gpus(node, tmp_path):
    ready = tmp_path / "ready"
    s = _script(tmp_path, "slowstop.py", f"""
        import signal, time, pathlib
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(600)
    """)
    _run(node, assignment(16, [PY, s], attempt=1, gpus=[2], stop_grace_s=1.0))
    wait_for(ready.exists, step=node.tick, what="start")
    _run(node, assignment(16, [PY, "-c", "print('second')"], attempt=2, gpus=[2]))
    assert (16, 2) in node.pending and (16, 2) not in node.attempts
    def second_finished():
        att = node.attempts.get((16, 2))
        return _status(node, 16, 2) if att is not None and att.finished else None

    st = wait_for(second_finished, step=node.tick, what="second attempt")
    first = node.attempts[(16, 1)]
    assert first.finished and first.finished_at <= node.attempts[(16, 2)].started_at
    assert st.ranks[0].exit_code == 0


def test_start_ticks_guard_against_pid_reuse():
    me = os.getpid()
    assert is_alive(me, start_ticks(me))
    assert not is_alive(me, (start_ticks(me) or 0) + 12345)


def test_hfreduce_ranks_really_run_on_their_numa_nodes_cpus(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    sysfs = tmp_path / "sys"
    d = sysfs / "devices" / "system" / "node" / "node0"
    d.mkdir(parents=True)
    (d / "cpulist").write_text(f"{cpus[0]}\n")
    node = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(1, node="n1", numa_nodes=[0]),
                     sysfs=str(sysfs))
    s = _script(tmp_path, "aff.py", "import os; print(sorted(os.sched_getaffinity(0)), os.environ['HAI_NUMA_NODE'])\n")
    node.apply([assignment(1, [PY, s], job_type="hfreduce", gpus=[0])])
    st = _finished(node, 1)
    assert st.ranks[0].exit_code == 0
    out = node.attempts[(1, 0)].rank_path(0, "stdout").read_text().strip()
    assert out == f"[{cpus[0]}] 0"
