"""GPU inventory and metrics: NVML (nvidia-ml-py) on real nodes, fake GPUs for development.

Also the node's topology helpers the launcher needs for ``hfreduce`` jobs: the NUMA node of a
PCI device, the CPUs of a NUMA node, the InfiniBand NICs and their NUMA nodes.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from collections.abc import Iterable, Mapping
from typing import Protocol

from hai.agent.topology import numa_cpus, parse_cpulist, pci_numa_node  # noqa: F401  (re-exported)
from hai.agent.topology import ib_devices, read as _read  # noqa: F401
from hai.protocol import GpuInfo, GpuMetrics, NicInfo

log = logging.getLogger("hai.agent.gpu")


class GpuBackend(Protocol):
    fake: bool

    def inventory(self) -> list[GpuInfo]: ...

    def metrics(self, busy: Mapping[int, int]) -> list[GpuMetrics]:
        """Current metrics; ``busy`` maps GPU index -> number of running ranks holding it."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- topology (sysfs)


def discover_nics(sysfs: str = "/sys") -> list[NicInfo]:
    """InfiniBand HCAs (/sys/class/infiniband/*) with their NUMA node; [] without InfiniBand."""
    return [NicInfo(name=name, numa_node=numa) for name, numa in ib_devices(sysfs)]


# ---------------------------------------------------------------- fake GPUs


class FakeGpus:
    """N fake GPUs whose utilisation follows the ranks running on them: 0 % when idle, high with
    a little noise while a rank of a job holds the GPU, so dashboards show something true."""

    fake = True
    MODEL = "HAI Fake A100-PCIE-40GB"
    MEMORY_MIB = 40960

    def __init__(self, count: int, *, node: str, seed: int | None = None,
                 numa_nodes: Iterable[int | None] | None = None):
        self.count = count
        self.node = node
        self._rng = random.Random(seed if seed is not None else node)
        self._lock = threading.Lock()
        self._numa = list(numa_nodes) if numa_nodes is not None else [None] * count

    def _uuid(self, i: int) -> str:
        # stable per node and index, shaped like a real one (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)
        h = hashlib.sha1(f"{self.node}/{i}".encode()).hexdigest()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def inventory(self) -> list[GpuInfo]:
        return [
            GpuInfo(index=i, uuid=self._uuid(i), model=self.MODEL, memory_total_mib=self.MEMORY_MIB,
                    numa_node=self._numa[i] if i < len(self._numa) else None)
            for i in range(self.count)
        ]

    def metrics(self, busy: Mapping[int, int]) -> list[GpuMetrics]:
        out = []
        with self._lock:
            for i in range(self.count):
                n = busy.get(i, 0)
                if n > 0:
                    util = min(100.0, max(0.0, self._rng.gauss(92.0, 3.0)))
                    mem = int(self.MEMORY_MIB * min(0.95, 0.6 + 0.1 * n) + self._rng.randint(-256, 256))
                    temp = 65.0 + self._rng.uniform(-2, 2)
                    power = 220.0 + self._rng.uniform(-15, 15)
                else:
                    util, mem = 0.0, 0
                    temp = 32.0 + self._rng.uniform(-1, 1)
                    power = 35.0 + self._rng.uniform(-2, 2)
                out.append(GpuMetrics(index=i, uuid=self._uuid(i), util_pct=round(util, 1),
                                      memory_used_mib=max(0, mem), memory_total_mib=self.MEMORY_MIB,
                                      temperature_c=round(temp, 1), power_w=round(power, 1),
                                      ecc_uncorrected=0))
        return out

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- NVML


class NvmlUnavailable(RuntimeError):
    pass


class NvmlGpus:
    """Real GPUs through NVML. ``indices`` restricts the agent to some of the node's GPUs (e.g.
    two agents on one host standing for two nodes); indices stay NVML's, and ranks get
    CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA numbers the devices the same way."""

    fake = False

    def __init__(self, *, indices: Iterable[int] | None = None, sysfs: str = "/sys"):
        try:
            import pynvml
        except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
            raise NvmlUnavailable(f"nvidia-ml-py is not installed: {e}") from e
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not be initialised ({e}); use --fake-gpus N on a machine "
                                  "without NVIDIA GPUs") from e
        self._lock = threading.Lock()
        count = pynvml.nvmlDeviceGetCount()
        wanted = sorted(set(indices)) if indices is not None else list(range(count))
        missing = [i for i in wanted if i < 0 or i >= count]
        if missing:
            raise NvmlUnavailable(f"GPU indices {missing} do not exist (this node has {count})")
        self._handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in wanted}
        self._static: dict[int, GpuInfo] = {}
        for i, h in self._handles.items():
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            if isinstance(name, bytes):
                name = name.decode()
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            numa = None
            try:
                bus = pynvml.nvmlDeviceGetPciInfo(h).busId
                numa = pci_numa_node(bus.decode() if isinstance(bus, bytes) else bus, sysfs)
            except pynvml.NVMLError:
                pass
            self._static[i] = GpuInfo(index=i, uuid=uuid, model=name,
                                      memory_total_mib=int(mem.total // (1024 * 1024)), numa_node=numa)

    def inventory(self) -> list[GpuInfo]:
        return [self._static[i] for i in sorted(self._static)]

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except self._nv.NVMLError:
            return None

    def metrics(self, busy: Mapping[int, int]) -> list[GpuMetrics]:
        nv = self._nv
        out = []
        with self._lock:
            for i in sorted(self._handles):
                h = self._handles[i]
                info = self._static[i]
                util = self._try(nv.nvmlDeviceGetUtilizationRates, h)
                mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
                temp = self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
                power = self._try(nv.nvmlDeviceGetPowerUsage, h)
                ecc = self._try(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                nv.NVML_VOLATILE_ECC)
                out.append(GpuMetrics(
                    index=i, uuid=info.uuid,
                    util_pct=float(util.gpu) if util is not None else 0.0,
                    memory_used_mib=int(mem.used // (1024 * 1024)) if mem is not None else 0,
                    memory_total_mib=info.memory_total_mib,
                    temperature_c=float(temp) if temp is not None else None,
                    power_w=round(power / 1000.0, 1) if power is not None else None,
                    ecc_uncorrected=int(ecc) if ecc is not None else None,
                ))
        return out

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except Exception:
            pass


def make_gpu_backend(*, fake_gpus: int | None, node: str, indices: Iterable[int] | None = None,
                     sysfs: str = "/sys") -> GpuBackend:
    if fake_gpus is not None:
        return FakeGpus(fake_gpus, node=node)
    return NvmlGpus(indices=indices, sysfs=sysfs)
