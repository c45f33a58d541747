"""Issue 12, protocol version 2: the agent keeps the server's rule for periodic quick rounds itself
(``Agent._count_round``): a round every ``quick_every_heartbeats`` answered heartbeats, the first
put off by 0 to every - 1 heartbeats by the node's name, counting only heartbeats that delivered
no results while no run is under way or asked for; none when the reply gives no period."""

from __future__ import annotations

import time
import zlib

from hai.agent.main import Agent, AgentOptions, _Result
from hai.protocol import ServerReply, ValidationReport, ValidationRequest


class _Runner:
    """Stands for the Validator: records the rounds the agent starts, busy while told."""

    def __init__(self) -> None:
        self.started = 0
        self.running = False

    def busy(self) -> bool:
        return self.running

    def own_round(self, expected) -> bool:  # noqa: ANN001
        assert expected  # the registered inventory goes with it
        if self.running:
            return False
        self.started += 1
        return True

    def acknowledge(self, sent, pending) -> None:  # noqa: ANN001
        pass

    def submit(self, requests) -> None:  # noqa: ANN001
        pass


def agent_for(tmp_path, name: str) -> tuple[Agent, _Runner]:  # noqa: ANN001
    agent = Agent(AgentOptions(server="http://127.0.0.1:9", token="t", node=name, state_dir=str(tmp_path / name),
                               fake_gpus=2))
    agent.validator = runner = _Runner()
    return agent, runner


def answer(agent: Agent, every: int, *, carried=(), asked=()) -> None:  # noqa: ANN001
    res = _Result(seq=agent._next_seq(), sent_at=time.time(), sent_mono=time.monotonic(), statuses=[],
                  validations=list(carried))
    reply = ServerReply(node=agent.node_name, assignments_digest="d", quick_every_heartbeats=every,
                        validations=list(asked))
    agent._apply_reply(res, reply)


def test_rounds_come_every_n_heartbeats_after_a_phase_by_the_nodes_name(tmp_path):
    every = 5
    names = [f"node-{i}" for i in range(12)]
    firsts = set()
    for name in names:
        agent, runner = agent_for(tmp_path, name)
        phase = zlib.crc32(name.encode()) % every
        starts = []
        for k in range(1, 4 * every + phase + 1):
            before = runner.started
            answer(agent, every)
            if runner.started > before:
                starts.append(k)
        assert starts == list(range(every + phase, 4 * every + phase + 1, every))
        firsts.add(starts[0])
    assert len(firsts) > 1  # nodes started together do not run their rounds in the same heartbeat


def test_no_round_is_counted_while_one_runs_or_a_run_is_asked_for_or_results_are_delivered(tmp_path):
    every = 3
    name = next(f"n{i}" for i in range(100) if zlib.crc32(f"n{i}".encode()) % every == 0)  # no phase
    agent, runner = agent_for(tmp_path, name)
    answer(agent, every)
    answer(agent, every)
    runner.running = True  # a requested run under way: not counted
    for _ in range(5):
        answer(agent, every)
    runner.running = False
    answer(agent, every, asked=[ValidationRequest(run_id=4, level="full")])  # one asked for: not counted
    report = ValidationReport(run_id=None, level="quick", started_at=1.0, finished_at=2.0)
    answer(agent, every, carried=[report])  # a heartbeat that delivered results: not counted
    assert runner.started == 0
    answer(agent, every)
    assert runner.started == 1
    for _ in range(3 * every):  # no period in the replies (version 1's server, or rounds off): none
        answer(agent, 0)
    assert runner.started == 1
