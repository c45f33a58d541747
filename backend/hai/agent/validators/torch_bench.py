"""GPU measurements with torch, one per process: ``python -m hai.agent.validators.torch_bench KIND
--gpus 0,1``. Prints one JSON line: {"value": ..., "data": {...}}, or {"skipped": why} when
torch or CUDA is missing, or {"error": ...}.

KIND: gemm (BF16 TFLOPS, min over GPUs), memtest (bad bytes over fill/verify patterns),
device_bw (device-to-device copy GB/s, read+write), h2d (pinned host-to-device GB/s),
allreduce (NCCL bus bandwidth GB/s across the GPUs, peak over 1 MiB-1 GiB messages), p2p (GPU-to-GPU
copy GB/s, min over ordered pairs); both report how the GPUs are linked (NVML: NVLink or PCIe).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _torch():  # noqa: ANN202
    try:
        import torch
    except ImportError:
        return None, "torch is not installed on this node"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA device here (torch.cuda.is_available() is False)"
    return torch, None


def _timed(torch, dev, fn, iters: int) -> float:  # noqa: ANN001
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(dev):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / 1000.0


def gemm(torch, gpus: list[int], burn_s: float) -> dict:  # noqa: ANN001
    n = 8192
    per = {}
    for g in gpus:
        dev = torch.device("cuda", g)
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize(dev)
        one = _timed(torch, dev, lambda: torch.matmul(a, b, out=c), 10) / 10
        iters = max(10, int(burn_s / max(one, 1e-6)))
        t = _timed(torch, dev, lambda: torch.matmul(a, b, out=c), iters)
        per[str(g)] = round(2 * n**3 * iters / t / 1e12, 1)
        del a, b, c
        torch.cuda.empty_cache()
    return {"value": min(per.values()), "data": {"per_gpu": per, "n": n, "dtype": "bfloat16", "burn_s": burn_s}}


def memtest(torch, gpus: list[int], burn_s: float) -> dict:  # noqa: ANN001
    bad_total = 0
    data = {}
    chunk = 1 << 30
    for g in gpus:
        dev = torch.device("cuda", g)
        free, _total = torch.cuda.mem_get_info(dev)
        size = int(max(0, free - (3 << 30)) * 0.9) // chunk * chunk
        if size <= 0:
            return {"skipped": f"GPU {g} has only {free / 2**30:.1f} GiB free"}
        t0 = time.perf_counter()
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
        bad = 0
        for pattern in (0x00, 0xFF, 0xAA, 0x55):
            buf.fill_(pattern)
            for part in buf.split(chunk):
                bad += int(torch.count_nonzero(part != pattern))
        # address pattern: every 8-byte word holds its own index
        words = buf.view(torch.int64)
        for i, part in enumerate(words.split(chunk // 8)):
            base = i * (chunk // 8)
            part.copy_(torch.arange(base, base + part.numel(), device=dev, dtype=torch.int64))
        for i, part in enumerate(words.split(chunk // 8)):
            base = i * (chunk // 8)
            bad += 8 * int(torch.count_nonzero(part != torch.arange(base, base + part.numel(), device=dev,
                                                                     dtype=torch.int64)))
        torch.cuda.synchronize(dev)
        data[str(g)] = {"tested_gib": round(size / 2**30, 1), "seconds": round(time.perf_counter() - t0, 2),
                        "bad_bytes": bad}
        bad_total += bad
        del buf, words
        torch.cuda.empty_cache()
    return {"value": bad_total, "data": {"per_gpu": data, "patterns": ["0x00", "0xFF", "0xAA", "0x55", "address"]}}


def device_bw(torch, gpus: list[int], burn_s: float) -> dict:  # noqa: ANN001
    size = 1 << 30
    per = {}
    for g in gpus:
        dev = torch.device("cuda", g)
        src = torch.empty(size // 4, dtype=torch.float32, device=dev).fill_(1.0)
        dst = torch.empty_like(src)
        dst.copy_(src)
        iters = 20
        t = _timed(torch, dev, lambda: dst.copy_(src), iters)
        per[str(g)] = round(2 * size * iters / t / 1e9, 1)
        del src, dst
        torch.cuda.empty_cache()
    return {"value": min(per.values()), "data": {"per_gpu": per, "bytes": size, "counts": "read+write"}}


def h2d(torch, gpus: list[int], burn_s: float) -> dict:  # noqa: ANN001
    size = 1 << 30
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    per, back = {}, {}
    for g in gpus:
        dev = torch.device("cuda", g)
        d = torch.empty(size, dtype=torch.uint8, device=dev)
        d.copy_(host, non_blocking=True)
        iters = 10
        t = _timed(torch, dev, lambda: d.copy_(host, non_blocking=True), iters)
        per[str(g)] = round(size * iters / t / 1e9, 2)
        t = _timed(torch, dev, lambda: host.copy_(d, non_blocking=True), iters)
        back[str(g)] = round(size * iters / t / 1e9, 2)
        del d
        torch.cuda.empty_cache()
    return {"value": min(per.values()), "data": {"per_gpu": per, "device_to_host_per_gpu": back, "bytes": size}}


# per-lane rate of a PCIe link, GB/s in each direction, by generation (after line encoding)
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# all-reduce message sizes swept: 1 MiB to 1 GiB
ALLREDUCE_SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]


def link(gpus: list[int]) -> dict:
    """How the GPUs are linked, from NVML (the agent's indices are NVML's: CUDA_DEVICE_ORDER is
    PCI_BUS_ID): {"kind": "nvlink"} when every pair reports NVLink peer-to-peer, with the
    active NVLinks of each GPU; else {"kind": "pcie", "gen", "width", "gbps"} from the slowest
    GPU's current PCIe link (GB/s in each direction); {"kind": "unknown", "why"} without NVML."""
    if len(set(gpus)) < 2:
        return {"kind": "none", "why": "one GPU: nothing to link"}
    try:
        import pynvml as nv
    except ImportError:
        return {"kind": "unknown", "why": "nvidia-ml-py is not installed"}
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        return {"kind": "unknown", "why": f"NVML: {e}"}
    try:
        hs = {g: nv.nvmlDeviceGetHandleByIndex(g) for g in gpus}
        if all(nv.nvmlDeviceGetP2PStatus(hs[a], hs[b], nv.NVML_P2P_CAPS_INDEX_NVLINK) == nv.NVML_P2P_STATUS_OK
               for a in gpus for b in gpus if a != b):
            active = {}
            for g, h in hs.items():
                n = 0
                for i in range(nv.NVML_NVLINK_MAX_LINKS):
                    try:
                        n += nv.nvmlDeviceGetNvLinkState(h, i) == nv.NVML_FEATURE_ENABLED
                    except nv.NVMLError:
                        break
                active[str(g)] = n
            return {"kind": "nvlink", "active_links": active}
        gens = [nv.nvmlDeviceGetCurrPcieLinkGeneration(h) for h in hs.values()]
        widths = [nv.nvmlDeviceGetCurrPcieLinkWidth(h) for h in hs.values()]
        gbps = min(PCIE_LANE_GBPS.get(gn, 0.0) * w for gn, w in zip(gens, widths))
        return {"kind": "pcie", "gen": min(gens), "width": min(widths), "gbps": round(gbps, 1)}
    except nv.NVMLError as e:
        return {"kind": "unknown", "why": f"NVML: {e}"}
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


def allreduce(torch, gpus: list[int], burn_s: float) -> dict:  # noqa: ANN001
    """NCCL all-reduce across the GPUs (one process, one communicator over them), message sizes
    from 1 MiB to 1 GiB: the bus bandwidth of each (nccl-tests' definition: algorithm bandwidth x
    2(n-1)/n) and the peak, which is the check's value."""
    if len(gpus) < 2:
        return {"skipped": "the node has one GPU: no intra-node allreduce"}
    import torch.cuda.nccl as nccl

    n = len(gpus)
    bufs = [torch.zeros(ALLREDUCE_SIZES[-1] // 4, dtype=torch.float32, device=torch.device("cuda", g)) for g in gpus]

    def sync() -> None:
        for g in gpus:
            torch.cuda.synchronize(g)

    curve = []
    for size in ALLREDUCE_SIZES:
        ts = [b[: size // 4] for b in bufs]
        nccl.all_reduce(ts)  # warm-up (the first also sets up the communicator)
        sync()
        iters = max(5, min(50, (8 << 30) // size))
        t0 = time.perf_counter()
        for _ in range(iters):
            nccl.all_reduce(ts)
        sync()
        t = (time.perf_counter() - t0) / iters
        algbw = size / t / 1e9
        curve.append({"bytes": size, "ms": round(t * 1000, 3), "algbw_gbps": round(algbw, 2),
                      "busbw_gbps": round(algbw * 2 * (n - 1) / n, 2)})
    del bufs
    torch.cuda.empty_cache()
    peak = max(curve, key=lambda c: c["busbw_gbps"])
    return {"value": peak["busbw_gbps"], "data": {"gpus": n, "curve": curve, "peak_bytes": peak["bytes"],
                                                  "link": link(gpus)}}


def p2p(torch, gpus: list[int], burn_s: float) -> dict:  # noqa: ANN001
    """GPU-to-GPU copy bandwidth of every ordered pair (both ways), 256 MiB copies; the value is
    the slowest pair's."""
    if len(gpus) < 2:
        return {"skipped": "the node has one GPU: no GPU-to-GPU copy"}
    size = 256 << 20
    bufs = {g: torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", g)) for g in gpus}
    per = {}
    for a in gpus:
        for b in gpus:
            if a == b:
                continue
            src, dst = bufs[a], bufs[b]
            dst.copy_(src)
            torch.cuda.synchronize(a)
            torch.cuda.synchronize(b)
            iters = 20
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(a)
            torch.cuda.synchronize(b)
            per[f"{a}->{b}"] = round(size * iters / (time.perf_counter() - t0) / 1e9, 2)
    del bufs
    torch.cuda.empty_cache()
    return {"value": min(per.values()), "data": {"per_pair": per, "bytes": size, "link": link(gpus)}}


BENCHES = {"gemm": gemm, "memtest": memtest, "device_bw": device_bw, "h2d": h2d, "allreduce": allreduce, "p2p": p2p}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hai.agent.validators.torch_bench")
    p.add_argument("kind", choices=sorted(BENCHES) + ["probe"])
    p.add_argument("--gpus", required=True)
    p.add_argument("--burn-s", type=float, default=5.0)
    a = p.parse_args(argv)
    torch, why = _torch()
    if torch is None:
        print(json.dumps({"skipped": why}))
        return 0
    if a.kind == "probe":  # torch with CUDA is here
        print(json.dumps({"value": torch.cuda.device_count(), "data": {"torch": torch.__version__}}))
        return 0
    gpus = [int(x) for x in a.gpus.split(",") if x.strip()]
    try:
        res = BENCHES[a.kind](torch, gpus, a.burn_s)
    except Exception as e:  # reported as the check's failure
        res = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
