"""Jobs run as the submitter (issue 13), with two real Unix accounts made for the test: a real
agent (root, with a user map) starts each rank under the account mapped to the submitting user;
the job's checkpoint and log folders are that account's, mode 0700; one user's job cannot read
the other's checkpoints; a user without a mapping (or mapped to root) is refused with a reason
and nothing runs. Without a map (development) ranks run as the agent's own user."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_stack, stop_stack

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="needs root and useradd to create the two Unix accounts")

# run by the system Python (readable by every account), isolated from the job's environment
PROBE = r"""
import json, os, stat, sys
def mode(p):
    st = os.stat(p)
    return {"uid": st.st_uid, "mode": oct(stat.S_IMODE(st.st_mode))}
ck, ctl = os.environ["HAI_CHECKPOINT_DIR"], os.environ["HAI_CONTROL_DIR"]
out = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "user": os.environ.get("USER"),
       "checkpoints": mode(ck), "logs": mode(os.path.join(os.path.dirname(ctl), "ranks")), "control": mode(ctl)}
with open(os.path.join(ck, "secret.txt"), "w") as f:
    f.write("only mine")
if len(sys.argv) > 1:
    for what, fn in (("list", lambda: os.listdir(sys.argv[1])),
                     ("read", lambda: open(os.path.join(sys.argv[1], "secret.txt")).read())):
        try:
            fn()
            out[what] = "allowed"
        except PermissionError:
            out[what] = "denied"
print("PROBE " + json.dumps(out), flush=True)
"""
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3")


@pytest.fixture
def unix_users():
    """Two throwaway accounts, removed afterwards."""
    names = [f"haim13{secrets.token_hex(3)}{i}" for i in (0, 1)]
    made = []
    try:
        for name in names:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                           capture_output=True, timeout=60)
            made.append(name)
        yield names
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, timeout=60)


@pytest.fixture
def open_tmp():
    """A folder every account can traverse (pytest's own tmp folder is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="hai-run-as-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _create_user(stack, name: str) -> str:
    out = stack.cli("admin", "create-user", name, "--group", "g", "--data-dir", str(stack.data_dir), check=True)
    return out.stdout.strip().splitlines()[-1]


def _submit(stack, token: str, *args: str) -> int:
    body = {"name": "probe", "command": [PYTHON, "-I", "-c", PROBE, *args], "gpus_per_node": 1}
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        r = c.post("/api/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return r.json()["id"]


def _probe(stack, job_id: int) -> dict:
    job = stack.wait_state(job_id, {"succeeded", "failed", "cancelled"}, timeout=180)
    logs = stack.logs(job_id)
    assert job["state"] == "succeeded", (job, logs)
    (line,) = [ln for ln in logs.splitlines() if "PROBE " in ln]
    return json.loads(line.split("PROBE ", 1)[1])


def test_ranks_run_as_the_mapped_account_with_private_folders(open_tmp, unix_users):
    import pwd

    a, b = unix_users
    uid_a, uid_b = pwd.getpwnam(a).pw_uid, pwd.getpwnam(b).pw_uid
    user_map = open_tmp / "users.map"
    user_map.write_text(f"# platform user -> Unix account\nalice {a}\nbob   {b}\nmallory root\n")
    stack = start_stack(open_tmp, agents=1, extra_env={"HAI_AGENT_USER_MAP": str(user_map)})
    try:
        alice, bob, carol, mallory = (_create_user(stack, n) for n in ("alice", "bob", "carol", "mallory"))
        job_a = _submit(stack, alice)
        got_a = _probe(stack, job_a)
        assert (got_a["uid"], got_a["euid"], got_a["user"]) == (uid_a, uid_a, a)
        assert got_a["uid"] != os.getuid()  # not the agent's root
        for folder in ("checkpoints", "logs", "control"):
            assert got_a[folder] == {"uid": uid_a, "mode": "0o700"}, (folder, got_a)

        ckpt_a = stack.data_dir / "checkpoints" / str(job_a) / "checkpoints"
        assert (ckpt_a / "secret.txt").read_text() == "only mine"
        st = ckpt_a.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid_a, 0o700)

        # bob's job, as bob's account, cannot list or read alice's checkpoints
        got_b = _probe(stack, _submit(stack, bob, str(ckpt_a)))
        assert got_b["uid"] == uid_b and got_b["checkpoints"]["uid"] == uid_b
        assert (got_b["list"], got_b["read"]) == ("denied", "denied")

        # no mapping, or a mapping to root: refused with the reason, nothing launched
        for token, why in ((carol, "has no Unix account"), (mallory, "jobs never run as root")):
            job = _submit(stack, token)
            done = stack.wait_state(job, {"succeeded", "failed", "cancelled"}, timeout=180)
            assert done["state"] == "failed", done
            assert why in (done["failure_reason"] or ""), done
            assert "PROBE" not in stack.logs(job)
    finally:
        stop_stack(stack)


def test_without_a_user_map_ranks_run_as_the_agent_user(open_tmp):
    """Development mode: ranks run as the agent's own user; the folders are still 0700."""
    stack = start_stack(open_tmp, agents=1)
    try:
        got = _probe(stack, _submit(stack, stack.admin_token))
        assert got["uid"] == os.getuid()
        assert got["checkpoints"] == {"uid": os.getuid(), "mode": "0o700"}
        assert got["logs"]["mode"] == "0o700"
    finally:
        stop_stack(stack)
