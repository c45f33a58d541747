"""Agent <-> server messages, versioned; imported by both sides.

Design (DESIGN.md pattern 6): state-based and replay-safe. The agent sends the full state of
every attempt it holds in each heartbeat; the server answers with the full set of assignments
for the node. Applying the same reply twice changes nothing, and after an agent restart the
agent reattaches to its still-running ranks (it re-reads them from its state directory) and
reports them again.

Versions (``messages.SUPPORTED_VERSIONS``; the server answers any other with a 426): 1, and 2
(issue 12), in which the agent runs its periodic quick validation rounds itself by
``ServerReply.quick_every_heartbeats`` and reports them without a run id. A server speaks both;
an agent of version 1 gets its rounds asked for as before.
"""

from hai.protocol.messages import *  # noqa: F401,F403
from hai.protocol.messages import __all__  # noqa: F401
from hai.protocol.node_state import NodeState  # noqa: F401,E402
from hai.protocol.validation import CheckResult, ValidationReport, ValidationRequest, round_phase  # noqa: F401,E402

__all__ = [*__all__, "NodeState", "CheckResult", "ValidationReport", "ValidationRequest", "round_phase"]
