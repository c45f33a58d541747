"""Schemathesis against a real `hai server` (issue 13): every phase (examples, coverage, fuzzing,
stateful), every check, positive and negative data (`--mode all`), three times — the whole
user API with an admin's token and with a member's (a researcher's: every admin operation must
refuse it as documented), and the agent protocol with the node credential. Prints and writes
the case counts and failures; exits 1 if any run found a problem.

    .venv/bin/python benchmarks/schemathesis_api.py --max-examples 10 --agent-max-examples 40   # 1,000+ cases each

tests/faults/test_schemathesis.py runs the same with a few examples per operation."""

from __future__ import annotations

import argparse
import json
import re
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = Path(__file__).resolve().parent / "schemathesis.toml"


@dataclass
class RunResult:
    name: str
    exit_code: int
    cases: int
    failures: int
    server_errors: int
    operations: int
    seconds: float
    summary: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `hai server` on embedded SQLite in a temporary folder, with bootstrap tokens."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = _free_port()
        self.admin = "hai_" + secrets.token_urlsafe(32)
        self.agent = "haiagent_" + secrets.token_urlsafe(32)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HAI_")} | {
            "HAI_DATA_DIR": str(tmp / "data"),
            "HAI_FRONTEND_DIST": str(tmp / "no-dashboard"),
            "HAI_AUTH__BOOTSTRAP_ADMIN_TOKEN": self.admin,
            "HAI_AUTH__BOOTSTRAP_AGENT_TOKEN": self.agent,
            # schemathesis sends thousands of requests with made-up tokens (ignored_auth): the
            # failed-authentication limit would answer 429 to the run's own client
            "HAI_LIMITS__AUTH_FAILURES": "1000000",
            # a followed log streams until its job ends (pings keep it alive): bounded here, or a
            # fuzzed `follow=true` on a queued job would hold the run forever
            "HAI_LIMITS__MAX_FOLLOW_S": "2",
        }
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        subprocess.run([sys.executable, "-m", "hai.cli.main", "migrate"], env=self.env, check=True,
                       capture_output=True, timeout=300)
        # a researcher's token (not an admin): the admin operations must refuse it as documented
        self.member = subprocess.run(
            [sys.executable, "-m", "hai.cli.main", "admin", "create-user", "rita", "--group", "research"],
            env=self.env, check=True, capture_output=True, text=True, timeout=300,
        ).stdout.strip().splitlines()[-1]
        self.log = (self.tmp / "server.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "hai.cli.main", "server", "--port", str(self.port)],
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.tmp)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {(self.tmp / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not answer in 120 s")
            time.sleep(0.2)
        self._seed()
        return self

    def _seed(self) -> None:
        """Something for the operations to find: two nodes, a job, a validation run."""
        agent = {"Authorization": f"Bearer {self.agent}"}
        for n in ("n0", "n1"):
            hello = {"node": n, "zone": "A", "leaf": "A1", "address": "127.0.0.1", "fake_gpus": True,
                     "gpus": [{"index": i, "uuid": f"GPU-{n}-{i}", "model": "Fake", "memory_total_mib": 1024}
                              for i in range(8)]}
            r = httpx.post(self.url + "/api/v1/agent/register", json=hello, headers=agent, timeout=30)
            r.raise_for_status()
        admin = {"Authorization": f"Bearer {self.admin}"}
        r = httpx.post(self.url + "/api/v1/jobs", json={"name": "seed", "command": ["true"], "gpus_per_node": 1},
                       headers=admin, timeout=30)
        r.raise_for_status()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def server_errors_logged(self) -> int:
        text = (self.tmp / "server.log").read_text(errors="replace")
        return sum(1 for line in text.splitlines() if '" 50' in line and "HTTP/1.1" in line)


def run_schemathesis(server: Server, *, name: str, token: str, tag_args: list[str], max_examples: int,
                     seed: int, out: Path, max_time_s: int | None = None,
                     phases: str = "examples,coverage,fuzzing,stateful") -> RunResult:
    report = out / f"{name}.junit.xml"
    cmd = [
        str(BIN / "schemathesis"), "--config-file", str(CONFIG), "run", f"{server.url}/openapi.json",
        "--mode", "all",
        "--phases", phases,
        "--checks", "all",
        "--max-examples", str(max_examples),
        "--seed", str(seed),
        "--workers", "1",
        "--generation-database", "none",
        "--request-timeout", "60",
        "--report", "junit", "--report-junit-path", str(report),
        "--no-color",
        *tag_args,
    ]
    if max_time_s:
        cmd += ["--max-time", str(max_time_s)]
    t0 = time.monotonic()
    # the token reaches schemathesis by environment (its config file reads ${HAI_ST_TOKEN}), so
    # it is neither in a command line nor in the output; the output goes to a file as it comes
    log_path = out / f"{name}.txt"
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=out,
                              env={**os.environ, "HAI_ST_TOKEN": token})
    seconds = time.monotonic() - t0
    text = log_path.read_text()
    cases, failures, operations = _count(text)
    server_errors = len(re.findall(r"\[5\d\d\] ", text))
    tail = text[text.rfind("SUMMARY"):] if "SUMMARY" in text else text[-3000:]
    return RunResult(name=name, exit_code=proc.returncode, cases=cases, failures=failures,
                     server_errors=server_errors, operations=operations, seconds=round(seconds, 1),
                     summary=tail.replace(token, "<token>")[-4000:])


def _count(text: str) -> tuple[int, int, int]:
    """Test cases generated, failures and operations tested, from schemathesis's summary."""
    generated = re.search(r"(\d+) generated", text)
    found = re.search(r"found (\d+) unique failures", text)
    tested = re.search(r"Tested: (\d+)", text)
    return (int(generated.group(1)) if generated else 0, int(found.group(1)) if found else 0,
            int(tested.group(1)) if tested else 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-examples", type=int, default=60, help="cases per operation and phase (schemathesis -n)")
    ap.add_argument("--agent-max-examples", type=int, default=None,
                    help="the same for the agent protocol's 3 operations (default: --max-examples)")
    ap.add_argument("--member-max-examples", type=int, default=None,
                    help="the same for the user API with a member's (not an admin's) token (default: --max-examples)")
    ap.add_argument("--member-phases", default="examples,coverage,fuzzing,stateful",
                    help="schemathesis phases of the member run (the suite leaves out coverage: the admin run covers it)")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "schemathesis")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "schemathesis.json")
    ap.add_argument("--max-time", type=int, default=None, help="seconds per run (fuzzing/stateful repeat until spent)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hai-schemathesis-") as tmp, Server(Path(tmp)) as server:
        results = [
            run_schemathesis(server, name="user-api", token=server.admin, tag_args=["--exclude-tag", "agent"],
                             max_examples=args.max_examples, seed=args.seed, out=args.out, max_time_s=args.max_time),
            run_schemathesis(server, name="user-api-member", token=server.member, tag_args=["--exclude-tag", "agent"],
                             max_examples=args.member_max_examples or args.max_examples, seed=args.seed, out=args.out,
                             max_time_s=args.max_time, phases=args.member_phases),
            run_schemathesis(server, name="agent-protocol", token=server.agent, tag_args=["--include-tag", "agent"],
                             max_examples=args.agent_max_examples or args.max_examples, seed=args.seed, out=args.out, max_time_s=args.max_time),
        ]
        logged_5xx = server.server_errors_logged()
    load = os.getloadavg()
    doc = {"max_examples": args.max_examples, "agent_max_examples": args.agent_max_examples or args.max_examples,
           "member_max_examples": args.member_max_examples or args.max_examples, "member_phases": args.member_phases,
           "seed": args.seed, "load_average": load, "server_5xx_logged": logged_5xx,
           "runs": [asdict(r) | {"summary": None} for r in results]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        print(f"{r.name}: exit {r.exit_code}, {r.cases} cases over {r.operations} operations, "
              f"{r.failures} failed checks, {r.server_errors} 5xx, {r.seconds} s")
        if r.exit_code != 0:
            print(r.summary)
    print(f"5xx lines in the server log: {logged_5xx}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0 if all(r.exit_code == 0 for r in results) and logged_5xx == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
