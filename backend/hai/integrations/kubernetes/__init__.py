"""The Kubernetes execution backend (HAI_EXECUTOR=kubernetes): the platform's scheduler decides,
Kubernetes runs one pod per node and attempt, pinned to that node.

- ``objects``: Node -> AgentHello, assignment -> pod/Service/parent ConfigMap, pod -> AttemptStatus.
- ``backend``: the reconciler, a fleet of in-process "virtual agents" (one per Kubernetes Node)
  that speak the agent protocol through ``platform`` (the one seam into the service layer).
- ``podwrap``: stdlib-only wrapper that runs each rank inside its container and bridges the SDK's
  control directory (suspend request in, checkpoint/suspend_ready events out).

Only this package imports ``kubernetes``; this ``__init__`` does not, so ``podwrap`` runs in job
images without it.
"""
