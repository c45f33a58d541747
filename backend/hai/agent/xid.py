"""NVIDIA Xid events from the kernel log: parse, classify, read.

The driver writes one line per event, e.g.::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

as seen in ``/dev/kmsg`` records (``4,1097,178046953,-;NVRM: Xid ...``), ``dmesg``
(``[ 1780.469530] NVRM: Xid ...``) and ``journalctl -k`` (``Dec 01 09:12:33 host kernel: NVRM:
Xid ...``). Older drivers omit ``PCI:``.

Classification follows Fire-Flyer 2's account (arXiv:2408.14158, table of Xid events): 74 NVLink,
79 the GPU fell off the bus, 48/63/64/92/94/95 memory ECC and row remapping — hardware, the node
is faulty; 13/31/43/45 are usually the application's (illegal address, MMU fault, a stopped or
preempted channel) — recorded, the node is not failed for them.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\): "
                  r"(?P<xid>\d+),\s*(?P<text>.*)$")

HARDWARE: dict[int, str] = {
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    48: "double-bit ECC error",
    63: "row remapping event (ECC page retirement)",
    64: "row remapping failure",
    92: "high single-bit ECC error rate",
    94: "contained memory error",
    95: "uncontained memory error",
}
APPLICATION: dict[int, str] = {
    13: "graphics engine exception (usually the application)",
    31: "GPU memory page fault (usually the application)",
    43: "GPU stopped processing (usually the application)",
    45: "preemptive cleanup (usually the application)",
}


@dataclass(frozen=True, slots=True)
class XidEvent:
    xid: int
    pci: str  # e.g. 0000:3b:00
    text: str  # the driver's words after the code
    kind: str  # nvlink | off_bus | memory | application | other
    hardware: bool
    meaning: str

    def to_json(self) -> dict:
        return asdict(self)


def classify(xid: int) -> tuple[str, bool, str]:
    """(kind, hardware, meaning) of an Xid code."""
    if xid == 74:
        return "nvlink", True, HARDWARE[74]
    if xid == 79:
        return "off_bus", True, HARDWARE[79]
    if xid in HARDWARE:
        return "memory", True, HARDWARE[xid]
    if xid in APPLICATION:
        return "application", False, APPLICATION[xid]
    return "other", False, f"Xid {xid} (not classified; recorded)"


def parse_line(line: str) -> XidEvent | None:
    """One kernel log line (kmsg record, dmesg or journalctl format) -> XidEvent, else None."""
    if "NVRM: Xid" not in line:
        return None
    # a kmsg record may carry " KEY=value" continuation lines after the message
    line = next(part for part in line.split("\n") if "NVRM: Xid" in part)
    m = _XID.search(line.rstrip("\r"))
    if m is None:
        return None
    xid = int(m.group("xid"))
    kind, hardware, meaning = classify(xid)
    return XidEvent(xid=xid, pci=m.group("pci").lower(), text=m.group("text").strip(), kind=kind,
                    hardware=hardware, meaning=meaning)


def parse_lines(lines) -> list[XidEvent]:  # noqa: ANN001
    return [e for e in (parse_line(line) for line in lines) if e is not None]


class KernelLogUnavailable(RuntimeError):
    pass


def read_kmsg(path: str = "/dev/kmsg", max_records: int = 200_000) -> list[str]:
    """Every record in the kernel ring buffer, without blocking (needs read access to
    /dev/kmsg: root or CAP_SYSLOG where dmesg_restrict is set)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise KernelLogUnavailable(f"cannot open {path}: {e.strerror}") from e
    lines = []
    try:
        for _ in range(max_records):
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # overwritten while we read: skip ahead
                    continue
                if e.errno == errno.EAGAIN:
                    break
                raise KernelLogUnavailable(f"reading {path}: {e.strerror}") from e
            if not rec:
                break
            lines.append(rec.decode(errors="replace"))
    finally:
        os.close(fd)
    return lines


def read_journal(timeout_s: float = 20.0) -> list[str]:
    exe = shutil.which("journalctl")
    if exe is None:
        raise KernelLogUnavailable("journalctl is not installed")
    try:
        out = subprocess.run([exe, "-k", "-b", "--no-pager", "-o", "short-monotonic", "--grep", "NVRM: Xid"],
                             capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelLogUnavailable(f"journalctl -k failed: {e}") from e
    if out.returncode not in (0, 1):  # 1: no match
        raise KernelLogUnavailable(f"journalctl -k exited {out.returncode}: {out.stderr.strip()[:200]}")
    return out.stdout.splitlines()


class KernelLog:
    """The node's kernel log: /dev/kmsg, else journalctl -k."""

    def __init__(self, kmsg: str = "/dev/kmsg"):
        self.kmsg = kmsg

    def lines(self) -> tuple[list[str], str]:
        """(lines, source). Raises KernelLogUnavailable when no source can be read."""
        errors = []
        try:
            return read_kmsg(self.kmsg), self.kmsg
        except KernelLogUnavailable as e:
            errors.append(str(e))
        try:
            return read_journal(), "journalctl -k"
        except KernelLogUnavailable as e:
            errors.append(str(e))
        raise KernelLogUnavailable("; ".join(errors))
