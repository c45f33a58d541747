"""Schemathesis in the suite (issue 13): every phase (examples, coverage, fuzzing, stateful),
every check, positive and negative data, against a real `hai server` — the user API with an
admin's and with a member's token, and the agent protocol with the node credential — with a few
cases per operation.
The long run (1,000+ cases each) is `benchmarks/schemathesis_api.py`, recorded in
benchmarks/README.md. Any failure schemathesis reports (exit 1) fails this test."""

from __future__ import annotations

import json

from benchmarks.schemathesis_api import main


def test_schemathesis_finds_nothing_in_the_api_or_the_agent_protocol(tmp_path):
    out = tmp_path / "st"
    # the member's run leaves out the coverage phase here (the admin's run has it; the benchmark
    # runs every phase for both): each operation gets examples, fuzzed and stateful cases
    rc = main(["--max-examples", "3", "--member-phases", "examples,fuzzing,stateful",
               "--out", str(out), "--json", str(tmp_path / "st.json")])
    doc = json.loads((tmp_path / "st.json").read_text())
    runs = {r["name"]: r for r in doc["runs"]}
    details = {name: (out / f"{name}.txt").read_text()[-3000:] for name in runs if runs[name]["exit_code"]}
    assert rc == 0, details
    user, member, agent = runs["user-api"], runs["user-api-member"], runs["agent-protocol"]
    assert user["operations"] >= 30 and member["operations"] == user["operations"] and agent["operations"] == 3, runs
    assert user["cases"] > 100 and member["cases"] > 60 and agent["cases"] > 20, runs
    assert user["failures"] == member["failures"] == agent["failures"] == 0 and doc["server_5xx_logged"] == 0
