"""End to end: `hai dev` with 2 fake-GPU agents on loopback; real job processes."""

from __future__ import annotations

import json

from tests.e2e.conftest import start_stack, stop_stack, wait_for


def test_two_node_job_prints_each_rank_and_succeeds(stack):
    job = stack.submit(
        name="ranks", nodes=2, gpus_per_node=8,
        command=["python3", "-c", "import os; print('hello from rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"],
    )
    done = stack.wait_state(job["id"], {"succeeded", "failed", "cancelled"})
    assert done["state"] == "succeeded", done
    assert done["exit_code"] == 0
    assert sorted(p["node"] for p in done["placement"]) == ["node-01", "node-02"]
    assert [e["to_state"] for e in done["events"]][:2] == ["queued", "starting"]
    logs = wait_for(lambda: (t := stack.logs(job["id"])).count("hello") == 2 and t, what="both ranks' lines")
    assert "[rank 0] hello from rank 0 of 2" in logs.splitlines()
    assert "[rank 1] hello from rank 1 of 2" in logs.splitlines()


def test_failing_command_ends_failed_with_its_exit_code(stack):
    job = stack.submit(name="fails", gpus_per_node=1, command=["bash", "-c", "echo about to fail; exit 7"])
    done = stack.wait_state(job["id"], {"succeeded", "failed", "cancelled"})
    assert done["state"] == "failed"
    assert done["exit_code"] == 7
    assert "exited with code 7" in done["failure_reason"]
    assert "about to fail" in wait_for(lambda: stack.logs(job["id"]), what="the failing job's log")


def test_cancelled_long_job_leaves_no_process_behind(stack):
    job = stack.submit(name="long", nodes=2, command=["bash", "-c", "echo started; sleep 600"])
    stack.wait_state(job["id"], {"running"})
    wait_for(lambda: len(stack.job_processes(job["id"])) >= 2, what="the job's processes")
    with stack.client() as c:
        assert c.post(f"/api/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
    # every rank is stopped and the GPUs come back
    wait_for(lambda: stack.job_processes(job["id"]) == [], timeout=60, what="no process left")
    with stack.client() as c:
        wait_for(lambda: all(n["free_gpus"] == n["gpus"] for n in c.get("/api/v1/nodes").json()), what="GPUs released")
    assert stack.job(job["id"])["state"] == "cancelled"


def test_cli_round_trip(stack):
    out = stack.cli("submit", "--gpus-per-node", "2", "--name", "cli", "--", "echo", "via cli", check=True)
    job_id = int(out.stdout.strip())
    stack.wait_state(job_id, {"succeeded"})
    assert "[rank 0] via cli" in stack.cli("logs", str(job_id), check=True).stdout
    follow = stack.cli("logs", "-f", str(job_id), check=True)
    assert "via cli" in follow.stdout and "ended: succeeded" in follow.stderr
    assert "succeeded" in stack.cli("jobs", check=True).stdout
    assert "node-01" in stack.cli("nodes", check=True).stdout
    bad = stack.cli("submit", "--nodes", "3", "--", "true")
    assert bad.returncode == 2 and "nodes" in bad.stderr
    assert stack.cli("cancel", str(job_id)).returncode == 1


def test_cli_array_runs_each_job_with_its_index(stack):
    """``hai submit --array N``: N jobs in one request (POST /api/v1/jobs/batch), each run by an
    agent with its HAI_ARRAY_INDEX and HAI_ARRAY_SIZE."""
    out = stack.cli("submit", "--array", "3", "--gpus-per-node", "1", "--name", "sweep", "--",
                    "sh", "-c", "echo index=$HAI_ARRAY_INDEX of $HAI_ARRAY_SIZE", check=True)
    ids = [int(line) for line in out.stdout.split()]
    assert len(ids) == 3 and ids == sorted(ids)
    for i, job_id in enumerate(ids):
        stack.wait_state(job_id, {"succeeded"})
        assert stack.job(job_id)["name"] == f"sweep-{i}"
        assert f"[rank 0] index={i} of 3" in stack.cli("logs", str(job_id), check=True).stdout
    def total() -> int:
        return json.loads(stack.cli("jobs", "--json", check=True).stdout)["total"]

    before = total()
    bad = stack.cli("submit", "--array", "2", "--nodes", "3", "--", "true")
    assert bad.returncode == 2 and "jobs.0.nodes" in bad.stderr
    assert total() == before  # nothing written


def test_cli_follow_ended_by_the_server_says_why_and_exits_1(tmp_path):
    """`hai logs -f` on a job that outlives the server's follow limit: the lines so far, then a
    note on stderr naming the limit, and exit code 1 (the job did not end)."""
    s = start_stack(tmp_path, agents=1, extra_env={"HAI_LIMITS__MAX_FOLLOW_S": "1"})
    try:
        job = s.submit(name="long", gpus_per_node=1, command=["bash", "-c", "echo started; sleep 600"])
        wait_for(lambda: "started" in s.logs(job["id"]), what="the job's first line")
        out = s.cli("logs", "-f", str(job["id"]))
        assert out.returncode == 1, out.stderr
        assert "[rank 0] started" in out.stdout.splitlines()
        assert f"following job {job['id']} stopped" in out.stderr and "HAI_LIMITS__MAX_FOLLOW_S" in out.stderr
    finally:
        stop_stack(s)
