"""Agent <-> server messages, versioned; imported by both sides.

Design (DESIGN.md pattern 6): state-based and replay-safe. The agent sends the full state of
every attempt it holds in each heartbeat; the server answers with the full set of assignments
for the node. Applying the same reply twice changes nothing, and after an agent restart the
agent reattaches to its still-running ranks (it re-reads them from its state directory) and
reports them again.
"""

from hai.protocol.messages import *  # noqa: F401,F403
from hai.protocol.messages import __all__  # noqa: F401
from hai.protocol.node_state import NodeState  # noqa: F401,E402
from hai.protocol.validation import CheckResult, ValidationReport, ValidationRequest  # noqa: F401,E402

__all__ = [*__all__, "NodeState", "CheckResult", "ValidationReport", "ValidationRequest"]
