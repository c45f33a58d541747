"""The validator catalogue: every check with its name, level, criticality and timeout, and the
suite runner. A check returns passed / failed (value, threshold, unit) / skipped (why): one that
cannot run here raises Skip and is never reported as passed."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from hai.agent.validators.model import Check, Context, Skip, expected_for, link_threshold
from hai.agent.xid import KernelLogUnavailable, parse_lines
from hai.protocol import CheckResult, GpuInfo

log = logging.getLogger("hai.agent.validators")


# ---------------------------------------------------------------------------- GPU (NVML)


def gpu_inventory(ctx: Context, c: Check) -> CheckResult:
    found = ctx.probe.gpus()
    expected = ctx.inventory
    if not expected:
        raise Skip("no registered inventory to compare with")
    problems = []
    by_index = {g.index: g for g in found}
    for e in expected:
        g = by_index.get(e.index)
        if g is None:
            problems.append(f"GPU {e.index} ({e.uuid}) is missing")
            continue
        if g.model != e.model:
            problems.append(f"GPU {e.index} is a {g.model}, registered as {e.model}")
        if abs(g.memory_total_mib - e.memory_total_mib) > max(64, e.memory_total_mib // 100):
            problems.append(f"GPU {e.index} has {g.memory_total_mib} MiB, registered with {e.memory_total_mib} MiB")
    extra = sorted(set(by_index) - {e.index for e in expected})
    if extra:
        problems.append(f"unregistered GPU(s) {extra}")
    status = "failed" if problems else "passed"
    return c.result(status, value=len(found), threshold=len(expected), unit="GPUs", detail="; ".join(problems),
                    data={"models": sorted({g.model for g in found})})


def gpu_ecc(ctx: Context, c: Check) -> CheckResult:
    counts = ctx.probe.ecc_uncorrected()
    known = {i: v for i, v in counts.items() if v is not None}
    if not known:
        raise Skip("the GPUs report no ECC counters (ECC disabled or not supported)")
    total = sum(known.values())
    bad = {str(i): v for i, v in known.items() if v}
    return c.at_most(total, 0, "uncorrected ECC errors",
                     detail=", ".join(f"GPU {i}: {v}" for i, v in bad.items()), data={"per_gpu": bad})


def gpu_retired_pages(ctx: Context, c: Check) -> CheckResult:
    pages = ctx.probe.retired_pages()
    if not pages:
        raise Skip("page retirement is not reported by these GPUs (they remap rows instead)")
    pending = [i for i, (_, p) in pages.items() if p]
    retired = {str(i): n for i, (n, _) in pages.items() if n}
    detail = "; ".join([f"GPU {i}: retirement pending (reset needed)" for i in pending]
                       + [f"GPU {i}: {n} page(s) retired for DBE" for i, n in retired.items()])
    # 60 DBE-retired pages is NVIDIA's replacement threshold
    value = len(pending) + sum(1 for n in retired.values() if n >= 60)
    return c.at_most(value, 0, "GPUs: retirement pending/excess", detail=detail, data={"retired": retired})


def gpu_remapped_rows(ctx: Context, c: Check) -> CheckResult:
    rows = ctx.probe.remapped_rows()
    if not rows:
        raise Skip("row remapping is not reported by these GPUs")
    bad = {i: r for i, r in rows.items() if r[1] or r[2]}
    detail = "; ".join(f"GPU {i}: " + ("remapping FAILED" if f else "remap pending (reset needed)")
                       for i, (_, p, f) in bad.items())
    return c.at_most(len(bad), 0, "GPUs: row remap pending/failed", detail=detail,
                     data={"uncorrectable_rows": {str(i): r[0] for i, r in rows.items() if r[0]}})


def gpu_throttle(ctx: Context, c: Check) -> CheckResult:
    reasons = ctx.probe.throttle()
    if not reasons:
        raise Skip("the GPUs report no clock-event reasons")
    bad = {str(i): r for i, r in reasons.items() if r}
    return c.at_most(len(bad), 0, "GPUs throttled by hardware",
                     detail="; ".join(f"GPU {i}: {', '.join(r)}" for i, r in bad.items()), data={"per_gpu": bad})


def gpu_xid(ctx: Context, c: Check) -> CheckResult:
    try:
        lines, source = ctx.probe.kernel_lines()
    except KernelLogUnavailable as e:
        raise Skip(f"the kernel log cannot be read: {e}") from e
    events = parse_lines(lines)
    hw = [e for e in events if e.hardware]
    app = [e for e in events if not e.hardware]

    def describe(es) -> str:  # noqa: ANN001
        seen = []
        for e in es:
            text = f"Xid {e.xid} ({e.meaning}) on PCI {e.pci}"
            if text not in seen:
                seen.append(text)
        return ", ".join(seen)

    detail = describe(hw)
    if app:
        detail += ("; " if detail else "") + f"recorded, not failing: {describe(app)}"
    return c.at_most(len(hw), 0, "hardware Xid events", detail=detail,
                     data={"source": source, "hardware": [e.to_json() for e in hw][:50],
                           "application": [e.to_json() for e in app][:50]})


# ---------------------------------------------------------------------------- GPU (torch)


def _idle(ctx: Context) -> list[int]:
    idle = ctx.idle_gpus()
    if not idle:
        raise Skip("every GPU is in use by a job; burn and bandwidth tests run on idle GPUs only")
    return idle


def _model(ctx: Context) -> str:
    gpus = ctx.probe.gpus() or ctx.inventory
    return gpus[0].model if gpus else ""


def gemm_tflops(ctx: Context, c: Check) -> CheckResult:
    exp = expected_for(_model(ctx))
    idle = _idle(ctx)
    res = ctx.bench.run("gemm", idle, c.timeout_s)
    if exp is None:
        raise Skip(f"no expected TFLOPS for {_model(ctx)!r}; measured {res['value']} TFLOPS")
    thr = exp[0] * ctx.thresholds.gemm_fraction
    return c.at_least(res["value"], thr, "TFLOPS",
                      detail=f"min over GPUs {idle}; expected {exp[0]:g} dense BF16 for {_model(ctx)}",
                      data={**res.get("data", {}), "expected_tflops": exp[0]})


def gpu_memtest(ctx: Context, c: Check) -> CheckResult:
    idle = _idle(ctx)
    res = ctx.bench.run("memtest", idle, c.timeout_s)
    return c.at_most(res["value"], 0, "bad bytes", detail=f"GPUs {idle}", data=res.get("data", {}))


def gpu_mem_bw(ctx: Context, c: Check) -> CheckResult:
    exp = expected_for(_model(ctx))
    idle = _idle(ctx)
    res = ctx.bench.run("device_bw", idle, c.timeout_s)
    if exp is None:
        raise Skip(f"no expected bandwidth for {_model(ctx)!r}; measured {res['value']} GB/s")
    return c.at_least(res["value"], exp[1] * ctx.thresholds.device_bw_fraction, "GB/s",
                      detail=f"device-to-device copy, min over GPUs {idle}; HBM {exp[1]:g} GB/s",
                      data={**res.get("data", {}), "expected_gbps": exp[1]})


def h2d_bw(ctx: Context, c: Check) -> CheckResult:
    idle = _idle(ctx)
    res = ctx.bench.run("h2d", idle, c.timeout_s)
    return c.at_least(res["value"], ctx.thresholds.h2d_min_gbps, "GB/s",
                      detail=f"pinned host-to-device, min over GPUs {idle}", data=res.get("data", {}))


def _multi(ctx: Context) -> list[int]:
    gpus = ctx.probe.gpus() or ctx.inventory
    if len(gpus) < 2:
        raise Skip("the node has one GPU")
    idle = _idle(ctx)
    if len(idle) < 2:
        raise Skip(f"fewer than two idle GPUs ({idle})")
    return idle


def nccl_allreduce(ctx: Context, c: Check) -> CheckResult:
    idle = _multi(ctx)
    res = ctx.bench.run("allreduce", idle, c.timeout_s)
    data = res.get("data", {})
    threshold, which = link_threshold(ctx.thresholds, "allreduce", data.get("link"))
    peak = data.get("peak_bytes")
    at = f", peak at {peak >> 20} MiB of 1 MiB-1 GiB" if peak else ""
    return c.at_least(res["value"], threshold, "GB/s",
                      detail=f"NCCL allreduce bus bandwidth across GPUs {idle}{at}; threshold for {which}", data=data)


def p2p_bw(ctx: Context, c: Check) -> CheckResult:
    idle = _multi(ctx)
    res = ctx.bench.run("p2p", idle, c.timeout_s)
    data = res.get("data", {})
    threshold, which = link_threshold(ctx.thresholds, "p2p", data.get("link"))
    return c.at_least(res["value"], threshold, "GB/s",
                      detail=f"GPU-to-GPU copy, slowest of every pair both ways; threshold for {which}", data=data)


# ---------------------------------------------------------------------------- host


def host_mem_bw(ctx: Context, c: Check) -> CheckResult:
    n = 128 << 20
    a, b = bytearray(n), bytearray(n)
    pa = (ctypes.c_char * n).from_buffer(a)
    pb = (ctypes.c_char * n).from_buffer(b)
    ctypes.memmove(pb, pa, n)  # touch the pages
    iters = 4
    t0 = time.perf_counter()
    for _ in range(iters):
        ctypes.memmove(pb, pa, n)
    t = time.perf_counter() - t0
    del pa, pb
    return c.at_least(2 * n * iters / t / 1e9, ctx.thresholds.host_mem_min_gbps, "GB/s",
                      detail="memmove of 128 MiB, read+write", data={"bytes": n})


def ib_ports(ctx: Context, c: Check) -> CheckResult:
    root = Path(ctx.sysfs) / "class" / "infiniband"
    try:
        hcas = sorted(p.name for p in root.iterdir())
    except OSError:
        raise Skip("no InfiniBand (/sys/class/infiniband is absent)") from None
    ports = []
    for hca in hcas:
        for port in sorted((root / hca / "ports").glob("*")):
            def rd(name: str) -> str:
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return ""
            rate_text = rd("rate")  # "200 Gb/sec (4X HDR)"
            try:
                rate = float(rate_text.split()[0])
            except (IndexError, ValueError):
                rate = 0.0
            ports.append({"port": f"{hca}/{port.name}", "state": rd("state"), "phys_state": rd("phys_state"),
                          "rate_gbps": rate, "link_layer": rd("link_layer")})
    if not ports:
        raise Skip("InfiniBand HCAs without ports")
    down = [p for p in ports if "ACTIVE" not in p["state"]]
    slow = [p for p in ports if p not in down and p["rate_gbps"] < ctx.thresholds.ib_min_gbps]
    detail = "; ".join([f"{p['port']} is {p['state'] or 'unknown'}" for p in down]
                       + [f"{p['port']} runs at {p['rate_gbps']:g} Gb/s" for p in slow])
    worst = min((p["rate_gbps"] if p not in down else 0.0) for p in ports)
    status = "failed" if down or slow else "passed"
    return c.result(status, value=worst, threshold=ctx.thresholds.ib_min_gbps, unit="Gb/s (slowest active port)",
                    detail=detail, data={"ports": ports})


def ckpt_free_space(ctx: Context, c: Check) -> CheckResult:
    root = ctx.checkpoint_root
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free / 2**30
    return c.at_least(free, ctx.thresholds.ckpt_min_free_gib, "GiB", detail=f"free in {root}")


def ckpt_write_bw(ctx: Context, c: Check) -> CheckResult:
    root = ctx.checkpoint_root
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 << 20)
    total = 128 << 20
    fd, path = tempfile.mkstemp(prefix=".hai-validate-", dir=root)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(total // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        t = time.perf_counter() - t0
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return c.at_least(total / t / 1e6, ctx.thresholds.ckpt_min_write_mbps, "MB/s",
                      detail=f"128 MiB written and fsynced in {root}")


# ---------------------------------------------------------------------------- the catalogue

CATALOGUE: tuple[Check, ...] = (
    Check("gpu_inventory", "quick", True, 30, gpu_inventory, "GPU count, models and memory match the registration"),
    Check("gpu_ecc", "quick", True, 30, gpu_ecc, "NVML uncorrected (volatile) ECC errors"),
    Check("gpu_retired_pages", "quick", True, 30, gpu_retired_pages, "pages retired for DBE, retirement pending"),
    Check("gpu_remapped_rows", "quick", True, 30, gpu_remapped_rows, "row remapping pending or failed"),
    Check("gpu_throttle", "quick", False, 30, gpu_throttle, "hardware/thermal/power-brake slowdown"),
    Check("gpu_xid", "quick", True, 30, gpu_xid, "Xid events in the kernel log, classified"),
    Check("ib_ports", "quick", True, 10, ib_ports, "InfiniBand port state and rate"),
    Check("ckpt_free_space", "quick", True, 10, ckpt_free_space, "free space of the checkpoint folder"),
    Check("gemm_tflops", "full", True, 300, gemm_tflops, "BF16 GEMM burn against the model's TFLOPS"),
    Check("gpu_memtest", "full", True, 600, gpu_memtest, "GPU memory fill/verify patterns"),
    Check("gpu_mem_bw", "full", True, 120, gpu_mem_bw, "device memory bandwidth"),
    Check("h2d_bw", "full", False, 120, h2d_bw, "host-to-device copy bandwidth"),
    Check("host_mem_bw", "full", False, 60, host_mem_bw, "host memory bandwidth"),
    Check("nccl_allreduce", "full", True, 180, nccl_allreduce, "intra-node NCCL allreduce"),
    Check("p2p_bw", "full", False, 120, p2p_bw, "GPU-to-GPU copy bandwidth"),
    Check("ckpt_write_bw", "full", False, 120, ckpt_write_bw, "write bandwidth of the checkpoint folder"),
)


def checks_for(level: str) -> list[Check]:
    return [c for c in CATALOGUE if level == "full" or c.level == "quick"]


def run_check(ctx: Context, check: Check) -> CheckResult:
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hai-check-{check.name}")
    fut = pool.submit(check.fn, ctx, check)
    try:
        res = fut.result(timeout=check.timeout_s * 1.1 + 0.5)  # the bench enforces timeout_s itself
    except Skip as e:
        res = check.result("skipped", detail=str(e))
    except (FutureTimeout, TimeoutError) as e:
        res = check.result("failed", detail=f"did not finish within {check.timeout_s:g}s ({e})".replace(" ()", ""))
    except Exception as e:  # a check that breaks is a failed check, with why
        log.exception("check %s raised", check.name)
        res = check.result("failed", detail=f"{type(e).__name__}: {e}")
    finally:
        pool.shutdown(wait=False)
    res.duration_s = round(time.perf_counter() - t0, 3)
    return res


def run_suite(ctx: Context, level: str, *, expected: list[GpuInfo] | None = None) -> list[CheckResult]:
    if expected:
        ctx = dataclasses.replace(ctx, inventory=list(expected))
    return [run_check(ctx, c) for c in checks_for(level)]
