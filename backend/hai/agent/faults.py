"""Injected hardware faults for fake-GPU agents: ``--inject-fault KIND[@SECONDS]`` (repeatable).

The fault appears SECONDS after the agent starts (at once without ``@``). Kinds:

- ``xid:N``: the kernel log gains an ``NVRM: Xid (PCI:...): N, ...`` line for GPU 0 (79: the GPU
  has fallen off the bus; 74: NVLink; 48/63/64/92/94/95: memory; 13/31/43/45: application);
- ``ecc``: GPU 0 reports uncorrected ECC errors;
- ``gpu-missing``: the last GPU disappears (the count no longer matches the inventory) and the
  job ranks holding it are killed (SIGKILL), as when a GPU falls off the bus under a job;
- ``slow-gemm``: the GEMM burn measures a fifth of the expected TFLOPS.

Otherwise only the validators' view of the hardware changes: the fake GPUs keep running the
jobs, so what the platform does about a fault is what is tested.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

KINDS = ("xid", "ecc", "gpu-missing", "slow-gemm")
_SPEC = re.compile(r"^(?P<kind>xid:(?P<xid>\d{1,3})|ecc|gpu-missing|slow-gemm)(?:@(?P<at>\d+(?:\.\d+)?))?$")

# real-format driver text for the injected Xid lines
XID_TEXT = {
    79: "pid=<unknown>, name=<unknown>, GPU has fallen off the bus.",
    74: "pid=<unknown>, name=<unknown>, NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, "
        "subpartition 0.",
    63: "pid=<unknown>, name=<unknown>, Row Remapper: New row marked for remapping, reset gpu to activate.",
    64: "pid=<unknown>, name=<unknown>, Row Remapper: Failed to remap a row.",
    94: "pid=<unknown>, name=<unknown>, Contained: SM (0x1). RST: No, D-RST: No",
    95: "pid=<unknown>, name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No",
    13: "pid=4242, name=python, Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    31: "pid=4242, name=python, Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted "
        "@ 0x7f2a_b1c00000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "pid=4242, name=python, Ch 00000010",
}


class BadFaultSpec(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str  # xid | ecc | gpu-missing | slow-gemm
    at_s: float = 0.0
    xid: int | None = None

    @property
    def label(self) -> str:
        return f"xid:{self.xid}" if self.kind == "xid" else self.kind


def parse_fault(spec: str) -> Fault:
    m = _SPEC.match(spec.strip())
    if m is None:
        raise BadFaultSpec(f"--inject-fault expects KIND[@SECONDS] with KIND one of xid:N, ecc, gpu-missing, "
                           f"slow-gemm; got {spec!r}")
    at = float(m.group("at") or 0.0)
    if m.group("xid") is not None:
        return Fault(kind="xid", at_s=at, xid=int(m.group("xid")))
    return Fault(kind=m.group("kind"), at_s=at)


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    clock: Callable[[], float] = time.time

    @classmethod
    def parse(cls, specs: list[str] | None, *, clock: Callable[[], float] = time.time) -> FaultPlan:
        return cls(faults=[parse_fault(s) for s in specs or []], started_at=clock(), clock=clock)

    def active(self) -> list[Fault]:
        """The faults that have appeared by now."""
        elapsed = self.clock() - self.started_at
        return [f for f in self.faults if elapsed >= f.at_s]

    def has(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.active())

    def xid_lines(self, pci: str) -> list[str]:
        """Kernel log lines (dmesg format) of the injected Xid faults that have appeared."""
        out = []
        for f in self.active():
            if f.kind == "xid":
                ts = f.at_s + 1.0
                out.append(f"[{ts:12.6f}] NVRM: Xid (PCI:{pci}): {f.xid}, "
                           + XID_TEXT.get(f.xid or 0, "pid=<unknown>, name=<unknown>, (injected)"))
        return out


log = logging.getLogger("hai.agent.faults")


class FaultEffects:
    """What a fault does to the processes on the node: ``gpu-missing`` kills the ranks on the
    GPU that disappeared (``gpu``), once, when the fault appears. ``pids_on(gpu)`` lists the live
    rank pids holding a GPU (the agent's view)."""

    def __init__(self, plan: FaultPlan, *, gpu: int, pids_on: Callable[[int], list[int]]):
        self.plan = plan
        self.gpu = gpu
        self.pids_on = pids_on
        self.fired = False

    def tick(self) -> bool:
        if self.fired or not self.plan.has("gpu-missing"):
            return False
        self.fired = True
        for pid in self.pids_on(self.gpu):
            log.warning("injected fault gpu-missing: GPU %s is gone, killing rank pid %s", self.gpu, pid)
            try:
                os.killpg(pid, signal.SIGKILL)  # ranks lead their own process group
            except OSError:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return True
