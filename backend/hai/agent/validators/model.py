"""What a check is, what it returns, and the figures it is judged against."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hai.protocol import CheckResult, GpuInfo

if TYPE_CHECKING:
    from hai.agent.validators.probes import DeviceProbe, GpuBench


class Skip(Exception):
    """The check cannot run on this machine; the message says why. Never reported as passed."""


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # quick | full (the full suite runs the quick checks too)
    critical: bool  # a failure makes the node unhealthy
    timeout_s: float
    fn: Callable[["Context", "Check"], CheckResult]
    description: str = ""

    def result(self, status: str, *, value: float | None = None, threshold: float | None = None, unit: str = "",
               detail: str = "", data: dict | None = None) -> CheckResult:
        return CheckResult(name=self.name, level=self.level, critical=self.critical, status=status,  # type: ignore[arg-type]
                           value=value, threshold=threshold, unit=unit, detail=detail, data=data or {})

    def at_least(self, value: float, threshold: float, unit: str, detail: str = "", data: dict | None = None) -> CheckResult:
        ok = value >= threshold
        return self.result("passed" if ok else "failed", value=round(value, 3), threshold=round(threshold, 3),
                           unit=unit, detail=detail if detail else ("" if ok else f"below {threshold:g} {unit}"),
                           data=data)

    def at_most(self, value: float, threshold: float, unit: str, detail: str = "", data: dict | None = None) -> CheckResult:
        ok = value <= threshold
        return self.result("passed" if ok else "failed", value=value, threshold=threshold, unit=unit,
                           detail=detail, data=data)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class Thresholds:
    """Pass marks. Fractions are of the GPU model's expected figure (EXPECTED below); the rest
    are absolute. Each can be set on the node with an environment variable HAI_VALIDATOR_<NAME>."""

    gemm_fraction: float = 0.6  # of the model's dense BF16 TFLOPS
    device_bw_fraction: float = 0.6  # of the model's HBM bandwidth
    h2d_min_gbps: float = 10.0
    host_mem_min_gbps: float = 2.0
    allreduce_min_gbps: float = 10.0  # bus bandwidth, when NVML cannot tell how the GPUs are linked
    p2p_min_gbps: float = 5.0  # likewise
    # GPUs linked by NVLink (NVML's peer-to-peer status): the public H100/H200 acceptance figure
    # for GPU-to-GPU copies between NVLink peers, and an all-reduce bus bandwidth floor
    p2p_nvlink_min_gbps: float = 335.0
    allreduce_nvlink_min_gbps: float = 200.0
    # GPUs linked by PCIe only: fractions of the slowest GPU's link rate in one direction
    p2p_pcie_fraction: float = 0.6
    allreduce_pcie_fraction: float = 0.5
    ib_min_gbps: float = 100.0
    ckpt_min_free_gib: float = 1.0
    ckpt_min_write_mbps: float = 20.0
    gemm_burn_s: float = 5.0

    @classmethod
    def from_env(cls) -> "Thresholds":
        base = cls()
        return cls(**{k: _env_float(f"HAI_VALIDATOR_{k.upper()}", getattr(base, k)) for k in base.__dataclass_fields__})


def link_threshold(t: "Thresholds", kind: str, link: dict | None) -> tuple[float, str]:
    """(threshold, which) for a multi-GPU measurement (``kind``: "allreduce" or "p2p") given how
    the GPUs are linked (``torch_bench.link``): NVLink peers have absolute floors, a PCIe-only
    node a fraction of its link rate, an unknown link the flat floors."""
    link = link or {}
    if link.get("kind") == "nvlink":
        v = t.allreduce_nvlink_min_gbps if kind == "allreduce" else t.p2p_nvlink_min_gbps
        return v, "NVLink peers"
    if link.get("kind") == "pcie" and link.get("gbps"):
        frac = t.allreduce_pcie_fraction if kind == "allreduce" else t.p2p_pcie_fraction
        return round(frac * link["gbps"], 1), (
            f"PCIe only: {frac:g} x the gen{link.get('gen')} x{link.get('width')} link's {link['gbps']:g} GB/s")
    v = t.allreduce_min_gbps if kind == "allreduce" else t.p2p_min_gbps
    return v, "link not known (NVML)"


# Expected figures per GPU model (first substring match, most specific first):
# (dense BF16 tensor TFLOPS, HBM bandwidth GB/s), from the vendors' data sheets.
EXPECTED: list[tuple[str, float, float]] = [
    ("H200 NVL", 835.0, 4800.0),
    ("H200", 989.0, 4800.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100 NVL", 835.0, 3900.0),
    ("H100", 989.0, 3350.0),
    ("H800", 989.0, 3350.0),
    ("A100-SXM4-80GB", 312.0, 2039.0),
    ("A100 80GB", 312.0, 1935.0),
    ("A100-PCIE-80GB", 312.0, 1935.0),
    ("A100", 312.0, 1555.0),
    ("A800", 312.0, 2039.0),
    ("L40S", 362.0, 864.0),
    ("A10", 125.0, 600.0),
    ("V100", 125.0, 900.0),
]


def expected_for(model: str) -> tuple[float, float] | None:
    for key, tflops, bw in EXPECTED:
        if key.lower() in model.lower():
            return tflops, bw
    return None


@dataclass
class Context:
    """What checks see of the node."""

    probe: "DeviceProbe"
    bench: "GpuBench"
    inventory: list[GpuInfo]  # what the node registered (the server's copy when it sent one)
    checkpoint_root: Path
    sysfs: str = "/sys"
    busy_gpus: Callable[[], set[int]] = field(default=lambda: set())
    thresholds: Thresholds = field(default_factory=Thresholds)

    def idle_gpus(self) -> list[int]:
        """GPUs no job rank holds now: only these get burn, memory and bandwidth tests."""
        busy = self.busy_gpus()
        return [g.index for g in self.probe.gpus() if g.index not in busy]
