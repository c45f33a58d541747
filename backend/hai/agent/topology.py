"""Host topology from sysfs and procfs, stdlib only: CPU lists, the NUMA node of a PCI device,
InfiniBand HCAs, which NIC a rank on a NUMA node uses, and the PCI bus id of each NVIDIA GPU.

Shared by the agent's launcher (hfreduce ranks bound to their GPU's NUMA node and NIC) and the
Kubernetes pod wrapper (``hai.integrations.kubernetes.podwrap --bind numa``), which runs in job
images and must not import more than the standard library.
"""

from __future__ import annotations

import os


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return sorted(set(cpus))


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _numa(text: str | None) -> int | None:
    try:
        node = int(text) if text is not None else None
    except ValueError:
        return None
    return node if node is not None and node >= 0 else None  # -1: the platform does not say


def pci_numa_node(bus_id: str, sysfs: str = "/sys") -> int | None:
    """NUMA node of a PCI device ('00000000:3B:00.0' as NVML writes it, or '0000:3b:00.0')."""
    bus = bus_id.strip().lower()
    domain, _, rest = bus.partition(":")
    if len(domain) > 4:
        domain = domain[-4:]
    return _numa(read(os.path.join(sysfs, "bus", "pci", "devices", f"{domain}:{rest}", "numa_node")))


def numa_cpus(node: int, sysfs: str = "/sys") -> list[int] | None:
    """CPUs of NUMA node ``node`` that this process may use; None when unknown or empty."""
    text = read(os.path.join(sysfs, "devices", "system", "node", f"node{node}", "cpulist"))
    if not text:
        return None
    cpus = parse_cpulist(text)
    try:
        allowed = os.sched_getaffinity(0)
        cpus = [c for c in cpus if c in allowed]
    except (AttributeError, OSError):
        pass
    return cpus or None


def ib_devices(sysfs: str = "/sys") -> list[tuple[str, int | None]]:
    """InfiniBand HCAs (/sys/class/infiniband/*) as (name, NUMA node); [] without InfiniBand."""
    root = os.path.join(sysfs, "class", "infiniband")
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [(name, _numa(read(os.path.join(root, name, "device", "numa_node")))) for name in names]


def nic_for(numa: int | None, nics: list[tuple[str, int | None]]) -> str | None:
    """The NIC a rank on NUMA node ``numa`` uses: the first on that node; none there (or the node
    unknown): all of them, comma-separated, so that NCCL chooses; None without InfiniBand."""
    if not nics:
        return None
    same = [name for name, n in nics if numa is not None and n == numa]
    if same:
        return same[0]
    return ",".join(name for name, _ in nics)


def nvidia_gpus(procfs: str = "/proc") -> list[tuple[str, str, int | None]]:
    """NVIDIA GPUs the driver lists in /proc/driver/nvidia/gpus/<bus id>/information, as
    (bus id, GPU UUID, device minor), in bus order."""
    root = os.path.join(procfs, "driver", "nvidia", "gpus")
    try:
        buses = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for bus in buses:
        fields: dict[str, str] = {}
        for line in (read(os.path.join(root, bus, "information")) or "").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        minor = fields.get("device minor")
        out.append((bus, fields.get("gpu uuid", ""), int(minor) if minor and minor.isdigit() else None))
    return out
