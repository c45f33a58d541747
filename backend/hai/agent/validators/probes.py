"""How checks see the hardware: a device probe (NVML, or fake GPUs with injected faults) and a
GPU bench (torch in a child process, or plausible fake figures).

The torch bench runs each measurement in its own process (``python -m
hai.agent.validators.torch_bench``): the agent never holds a CUDA context beside the jobs, and
a check's timeout can really stop it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from typing import Protocol

from hai.agent.faults import FaultPlan
from hai.agent.validators.model import Skip, expected_for
from hai.agent.xid import KernelLog
from hai.protocol import GpuInfo

# NVML clock-event (throttle) reasons that mean the hardware is slowing the GPU down
_BAD_THROTTLE = {
    0x0000000000000008: "hardware slowdown",
    0x0000000000000040: "hardware thermal slowdown",
    0x0000000000000080: "hardware power brake slowdown",
    0x0000000000000020: "software thermal slowdown",
}


class DeviceProbe(Protocol):
    fake: bool

    def gpus(self) -> list[GpuInfo]: ...
    def pci(self, index: int) -> str: ...
    def ecc_uncorrected(self) -> dict[int, int | None]: ...
    def retired_pages(self) -> dict[int, tuple[int, bool]]: ...  # (pages retired for DBE, retirement pending)
    def remapped_rows(self) -> dict[int, tuple[int, bool, bool]]: ...  # (uncorrectable rows, pending, failure)
    def throttle(self) -> dict[int, list[str]]: ...
    def kernel_lines(self) -> tuple[list[str], str]: ...


class GpuBench(Protocol):
    def run(self, kind: str, gpus: list[int], timeout_s: float) -> dict:
        """{'value': float, 'data': {...}}; raises Skip(why)."""
        ...


# ---------------------------------------------------------------------------- fake


class FakeProbe:
    """Fake GPUs: healthy figures unless a fault was injected (agent/faults.py)."""

    fake = True

    def __init__(self, inventory: list[GpuInfo], faults: FaultPlan | None = None):
        self._inventory = list(inventory)
        self.faults = faults or FaultPlan()

    def gpus(self) -> list[GpuInfo]:
        gpus = list(self._inventory)
        if self.faults.has("gpu-missing") and gpus:
            gpus = gpus[:-1]
        return gpus

    def pci(self, index: int) -> str:
        return f"0000:{index + 1:02x}:00"

    def ecc_uncorrected(self) -> dict[int, int | None]:
        bad = self.faults.has("ecc")
        return {g.index: (2 if bad and g.index == self._inventory[0].index else 0) for g in self.gpus()}

    def retired_pages(self) -> dict[int, tuple[int, bool]]:
        return {g.index: (0, False) for g in self.gpus()}

    def remapped_rows(self) -> dict[int, tuple[int, bool, bool]]:
        return {g.index: (0, False, False) for g in self.gpus()}

    def throttle(self) -> dict[int, list[str]]:
        return {g.index: [] for g in self.gpus()}

    def kernel_lines(self) -> tuple[list[str], str]:
        first = self._inventory[0].index if self._inventory else 0
        return self.faults.xid_lines(self.pci(first)), "fake kernel log"


class FakeBench:
    """Plausible figures for fake GPUs (a fraction of the model's expected figure, a little noise);
    ``slow-gemm`` makes the GEMM burn slow."""

    def __init__(self, inventory: list[GpuInfo], faults: FaultPlan | None = None, seed: int = 0):
        self.model = inventory[0].model if inventory else "HAI Fake A100-PCIE-40GB"
        self.mem_mib = inventory[0].memory_total_mib if inventory else 40960
        self.faults = faults or FaultPlan()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _noise(self) -> float:
        with self._lock:
            return self._rng.uniform(0.98, 1.02)

    def run(self, kind: str, gpus: list[int], timeout_s: float) -> dict:
        exp = expected_for(self.model) or (312.0, 1555.0)
        n = len(gpus)
        if kind == "gemm":
            frac = 0.2 if self.faults.has("slow-gemm") else 0.9
            per = {str(g): round(exp[0] * frac * self._noise(), 1) for g in gpus}
            return {"value": min(per.values()), "data": {"per_gpu": per, "fake": True}}
        if kind == "memtest":
            gib = round(self.mem_mib * 0.85 / 1024, 1)
            return {"value": 0, "data": {"tested_gib_per_gpu": gib, "seconds": round(0.05 * n, 3), "fake": True}}
        if kind == "device_bw":
            per = {str(g): round(exp[1] * 0.88 * self._noise(), 1) for g in gpus}
            return {"value": min(per.values()), "data": {"per_gpu": per, "fake": True}}
        if kind == "h2d":
            per = {str(g): round(24.5 * self._noise(), 2) for g in gpus}
            return {"value": min(per.values()), "data": {"per_gpu": per, "fake": True}}
        if kind == "allreduce":
            return {"value": round(22.0 * self._noise(), 2), "data": {"gpus": n, "fake": True}}
        if kind == "p2p":
            return {"value": round(20.0 * self._noise(), 2), "data": {"gpus": n, "fake": True}}
        raise Skip(f"unknown bench {kind}")


# ---------------------------------------------------------------------------- real


class NvmlProbe:
    """The node's GPUs through NVML (nvidia-ml-py); ``indices``: the agent's GPUs."""

    fake = False

    def __init__(self, indices: list[int], kernel_log: KernelLog | None = None):
        import pynvml

        self._nv = pynvml
        pynvml.nvmlInit()  # reference counted: the agent's GPU backend holds its own
        self.indices = list(indices)
        self.kernel_log = kernel_log or KernelLog()

    def _handles(self) -> dict[int, object]:
        nv = self._nv
        count = nv.nvmlDeviceGetCount()
        return {i: nv.nvmlDeviceGetHandleByIndex(i) for i in self.indices if i < count}

    def _try(self, fn, *args):  # noqa: ANN001, ANN202
        try:
            return fn(*args)
        except self._nv.NVMLError:
            return None

    def gpus(self) -> list[GpuInfo]:
        nv = self._nv
        out = []
        for i, h in self._handles().items():
            name = self._try(nv.nvmlDeviceGetName, h)
            uuid = self._try(nv.nvmlDeviceGetUUID, h)
            mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
            if name is None or uuid is None or mem is None:
                continue  # the GPU does not answer: it is missing
            out.append(GpuInfo(index=i, uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                               model=name.decode() if isinstance(name, bytes) else name,
                               memory_total_mib=int(mem.total // (1024 * 1024))))
        return out

    def pci(self, index: int) -> str:
        h = self._handles().get(index)
        info = self._try(self._nv.nvmlDeviceGetPciInfo, h) if h is not None else None
        if info is None:
            return "?"
        bus = info.busId.decode() if isinstance(info.busId, bytes) else info.busId
        return bus.lower()

    def ecc_uncorrected(self) -> dict[int, int | None]:
        nv = self._nv
        out = {}
        for i, h in self._handles().items():
            v = self._try(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            out[i] = int(v) if v is not None else None
        return out

    def retired_pages(self) -> dict[int, tuple[int, bool]]:
        nv = self._nv
        out = {}
        for i, h in self._handles().items():
            pages = self._try(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
            pending = self._try(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
            if pages is None and pending is None:
                continue  # not supported (Ampere and later remap rows instead)
            out[i] = (len(pages or []), bool(pending))
        return out

    def remapped_rows(self) -> dict[int, tuple[int, bool, bool]]:
        out = {}
        for i, h in self._handles().items():
            rows = self._try(self._nv.nvmlDeviceGetRemappedRows, h)
            if rows is None:
                continue
            _corr, unc, pending, failure = rows
            out[i] = (int(unc), bool(pending), bool(failure))
        return out

    def throttle(self) -> dict[int, list[str]]:
        nv = self._nv
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        out = {}
        for i, h in self._handles().items():
            mask = self._try(fn, h)
            if mask is None:
                continue
            out[i] = [why for bit, why in _BAD_THROTTLE.items() if mask & bit]
        return out

    def kernel_lines(self) -> tuple[list[str], str]:
        return self.kernel_log.lines()


class TorchBench:
    """Each measurement in a child process running torch (the job runtime on GPU nodes)."""

    def __init__(self, python: str = sys.executable, burn_s: float = 5.0):
        self.python = python
        self.burn_s = burn_s
        self._missing: str | None = None  # why torch/CUDA cannot run here, once known
        self._lock = threading.Lock()

    def run(self, kind: str, gpus: list[int], timeout_s: float) -> dict:
        with self._lock:
            if self._missing is None:
                try:
                    self._run("probe", gpus, min(timeout_s, 120.0))
                    self._missing = ""
                except Skip as e:
                    self._missing = str(e)
        if self._missing:
            raise Skip(self._missing)
        return self._run(kind, gpus, timeout_s)

    def _run(self, kind: str, gpus: list[int], timeout_s: float) -> dict:
        cmd = [self.python, "-m", "hai.agent.validators.torch_bench", kind, "--gpus", ",".join(map(str, gpus)),
               "--burn-s", str(self.burn_s)]
        env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        env.pop("CUDA_VISIBLE_DEVICES", None)  # NVML indices == CUDA indices
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"the {kind} measurement did not finish within {timeout_s:g}s") from e
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"torch_bench {kind} exited {out.returncode}: {out.stderr.strip()[-400:]}")
        res = json.loads(lines[-1])
        if "skipped" in res:
            raise Skip(res["skipped"])
        if "error" in res:
            raise RuntimeError(res["error"])
        return res
