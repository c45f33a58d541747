"""The agent's configuration is one AgentOptions record, whether it comes from `hai agent` or
from keywords."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hai.agent.main import Agent, AgentOptions, run_agent


def test_keywords_and_options_configure_the_same_agent(tmp_path):
    opts = AgentOptions(server="http://127.0.0.1:9", token="t", node="n1", state_dir=str(tmp_path), fake_gpus=2,
                        heartbeat_wait_s=120, kill_grace_s=3)
    agent = Agent(opts)
    assert agent.wait_s == 60.0  # the protocol's long-poll bound
    assert agent.node.kill_grace_s == 3 and len(agent.node.gpu_inventory) == 2
    assert [p.name for p in agent.periodic] == ["hai-agent-supervise", "hai-agent-tail"]


def test_an_unknown_option_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(TypeError, match="no_such_option"):
        run_agent(server="http://127.0.0.1:9", token="t", node="n1", state_dir=str(tmp_path / "s"), no_such_option=1)
    assert not (tmp_path / "s").exists()


def test_every_cli_option_of_hai_agent_is_an_agent_option():
    import inspect

    from hai.cli.main import agent as cli_agent

    fields = {f.name for f in dataclasses.fields(AgentOptions)}
    cli = set(inspect.signature(cli_agent).parameters) - {"gpus"}  # --gpus is parsed into gpu_indices
    assert cli <= fields and "gpu_indices" in fields


# -- a root agent without a user map (issue 13: nothing runs as root on a user's behalf) ----------

ROOT_ARGS = ["agent", "--server", "http://127.0.0.1:9", "--token", "t" * 20, "--node", "n1", "--fake-gpus", "1"]


@pytest.fixture
def as_root(monkeypatch, tmp_path):
    """`hai agent` believing it runs as root; what it would have started is recorded, not run."""
    import hai.agent.main as agent_main

    started: list[AgentOptions] = []
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr(agent_main.Agent, "run", lambda self: started.append(self.options))
    monkeypatch.delenv("HAI_AGENT_USER_MAP", raising=False)
    monkeypatch.delenv("HAI_AGENT_RANKS_AS_AGENT_USER", raising=False)
    return started, [*ROOT_ARGS, "--state-dir", str(tmp_path / "state")]


def test_a_root_agent_without_a_user_map_refuses_to_start_with_exit_code_2(as_root):
    from typer.testing import CliRunner

    from hai.cli.main import app

    started, args = as_root
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2
    assert "runs as root and has no user map" in out.output and "--user-map" in out.output
    assert started == []  # nothing started, no state folder made
    assert not Path(args[-1]).exists()
    with pytest.raises(SystemExit, match="runs as root and has no user map"):  # the same rule in-process
        run_agent(server="http://127.0.0.1:9", token="t", node="n1", state_dir=args[-1], fake_gpus=1)
    assert started == []


@pytest.mark.parametrize("extra, env", [
    (["--ranks-as-agent-user"], {}),
    ([], {"HAI_AGENT_RANKS_AS_AGENT_USER": "1"}),
    (["--user-map", "MAP"], {}),
    ([], {"HAI_AGENT_USER_MAP": "MAP"}),
])
def test_a_root_agent_starts_with_a_user_map_or_when_told_ranks_run_as_itself(as_root, tmp_path, extra, env):
    from typer.testing import CliRunner

    from hai.cli.main import app

    started, args = as_root
    user_map = tmp_path / "users"
    user_map.write_text("alice alice\n")
    extra = [str(user_map) if x == "MAP" else x for x in extra]
    env = {k: (str(user_map) if v == "MAP" else v) for k, v in env.items()}
    out = CliRunner().invoke(app, [*args, *extra], env=env)
    assert out.exit_code == 0, out.output
    expected_map = str(user_map) if str(user_map) in [*extra, *env.values()] else None
    assert len(started) == 1
    assert started[0].user_map == expected_map and started[0].ranks_as_agent_user is (expected_map is None)
