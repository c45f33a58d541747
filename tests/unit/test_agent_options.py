"""The agent's configuration is one AgentOptions record, whether it comes from `hai agent` or
from keywords."""

from __future__ import annotations

import dataclasses

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
