"""Each validator check's pass / fail / skip logic (issue 10), the fault injection that drives
them on fake GPUs, and the agent-side runner (each run once, reports kept until acknowledged)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from hai.agent.faults import BadFaultSpec, Fault, FaultEffects, FaultPlan, parse_fault
from hai.agent.gpu import FakeGpus
from hai.agent.testing import wait_for
from hai.agent.validators import CATALOGUE, Validator, checks_for, make_context, run_check, run_suite
from hai.agent.validators.model import Check, Skip, Thresholds, expected_for
from hai.agent.validators.probes import FakeProbe, TorchBench
from hai.agent.xid import KernelLogUnavailable
from hai.protocol import GpuInfo, ValidationRequest

BY_NAME = {c.name: c for c in CATALOGUE}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ctx_for(tmp_path, *faults: str, gpus: int = 8, clock=None, **kw):  # noqa: ANN001
    inv = FakeGpus(gpus, node="n").inventory()
    plan = FaultPlan.parse(list(faults), clock=clock or time.time)
    return make_context(fake=True, inventory=inv, checkpoint_root=tmp_path / "ckpt", sysfs=str(tmp_path / "sys"),
                        faults=plan, **kw)


def run(ctx, name: str):  # noqa: ANN001, ANN201
    return run_check(ctx, BY_NAME[name])


class StubProbe(FakeProbe):
    """A fake probe whose NVML answers a test sets."""

    def __init__(self, inventory, **answers):  # noqa: ANN001
        super().__init__(inventory)
        self.answers = answers

    def ecc_uncorrected(self):  # noqa: ANN201
        return self.answers.get("ecc", super().ecc_uncorrected())

    def retired_pages(self):  # noqa: ANN201
        return self.answers.get("retired", super().retired_pages())

    def remapped_rows(self):  # noqa: ANN201
        return self.answers.get("remapped", super().remapped_rows())

    def throttle(self):  # noqa: ANN201
        return self.answers.get("throttle", super().throttle())

    def kernel_lines(self):  # noqa: ANN201
        if "kernel" in self.answers:
            k = self.answers["kernel"]
            if isinstance(k, Exception):
                raise k
            return k, "test"
        return super().kernel_lines()


def with_probe(ctx, **answers):  # noqa: ANN001, ANN201
    return dataclasses.replace(ctx, probe=StubProbe(ctx.inventory, **answers))


# -- the catalogue -------------------------------------------------------------------------
def test_catalogue_levels_and_criticality():
    quick = [c.name for c in checks_for("quick")]
    full = [c.name for c in checks_for("full")]
    assert set(quick) < set(full) and all(c.level == "quick" for c in checks_for("quick"))
    assert {"gpu_inventory", "gpu_ecc", "gpu_retired_pages", "gpu_remapped_rows", "gpu_throttle", "gpu_xid",
            "ib_ports", "ckpt_free_space"} == set(quick)
    assert {"gemm_tflops", "gpu_memtest", "gpu_mem_bw", "host_mem_bw", "h2d_bw", "nccl_allreduce", "p2p_bw",
            "ckpt_write_bw"} == set(full) - set(quick)
    assert all(c.timeout_s > 0 for c in CATALOGUE)
    assert BY_NAME["gpu_xid"].critical and BY_NAME["gemm_tflops"].critical and not BY_NAME["host_mem_bw"].critical


def test_healthy_fake_node_passes_with_plausible_figures(tmp_path):
    results = {r.name: r for r in run_suite(ctx_for(tmp_path), "full")}
    assert results["ib_ports"].status == "skipped"  # no InfiniBand here: never "passed"
    assert all(r.status == "passed" for n, r in results.items() if n != "ib_ports"), results
    gemm = results["gemm_tflops"]
    assert gemm.unit == "TFLOPS" and gemm.threshold == pytest.approx(312 * 0.6) and 250 < gemm.value < 312
    assert results["gpu_mem_bw"].value > results["gpu_mem_bw"].threshold
    assert all(r.duration_s >= 0 for r in results.values())


# -- GPU (NVML) checks ------------------------------------------------------------------------
def test_inventory_pass_fail_skip(tmp_path):
    ctx = ctx_for(tmp_path)
    assert run(ctx, "gpu_inventory").status == "passed"
    missing = run(ctx_for(tmp_path, "gpu-missing"), "gpu_inventory")
    assert (missing.status, missing.value, missing.threshold) == ("failed", 7, 8)
    assert "GPU 7" in missing.detail and "missing" in missing.detail
    other = [GpuInfo(index=g.index, uuid=g.uuid, model="NVIDIA H100 80GB HBM3", memory_total_mib=81559)
             for g in ctx.inventory]
    wrong = run(dataclasses.replace(ctx, inventory=other), "gpu_inventory")
    assert wrong.status == "failed" and "registered as NVIDIA H100" in wrong.detail and "MiB" in wrong.detail
    assert run(dataclasses.replace(ctx, inventory=[]), "gpu_inventory").status == "skipped"


def test_ecc_pass_fail_skip(tmp_path):
    assert run(ctx_for(tmp_path), "gpu_ecc").status == "passed"
    bad = run(ctx_for(tmp_path, "ecc"), "gpu_ecc")
    assert (bad.status, bad.value, bad.threshold, bad.unit) == ("failed", 2, 0, "uncorrected ECC errors")
    assert "GPU 0: 2" in bad.detail
    none = run(with_probe(ctx_for(tmp_path), ecc={0: None, 1: None}), "gpu_ecc")
    assert none.status == "skipped" and "ECC" in none.detail


def test_retired_pages_pass_fail_skip(tmp_path):
    ctx = ctx_for(tmp_path)
    assert run(ctx, "gpu_retired_pages").status == "passed"
    assert run(with_probe(ctx, retired={0: (0, True)}), "gpu_retired_pages").status == "failed"
    assert run(with_probe(ctx, retired={0: (61, False)}), "gpu_retired_pages").status == "failed"
    assert run(with_probe(ctx, retired={0: (3, False)}), "gpu_retired_pages").status == "passed"
    assert run(with_probe(ctx, retired={}), "gpu_retired_pages").status == "skipped"


def test_remapped_rows_pass_fail_skip(tmp_path):
    ctx = ctx_for(tmp_path)
    assert run(ctx, "gpu_remapped_rows").status == "passed"
    r = run(with_probe(ctx, remapped={0: (1, True, False), 1: (0, False, True)}), "gpu_remapped_rows")
    assert r.status == "failed" and r.value == 2 and "pending" in r.detail and "FAILED" in r.detail
    assert run(with_probe(ctx, remapped={}), "gpu_remapped_rows").status == "skipped"


def test_throttle_pass_fail_skip(tmp_path):
    ctx = ctx_for(tmp_path)
    assert run(ctx, "gpu_throttle").status == "passed"
    r = run(with_probe(ctx, throttle={0: [], 3: ["hardware thermal slowdown"]}), "gpu_throttle")
    assert r.status == "failed" and "GPU 3: hardware thermal slowdown" in r.detail and not r.critical
    assert run(with_probe(ctx, throttle={}), "gpu_throttle").status == "skipped"


def test_xid_pass_fail_skip(tmp_path):
    ctx = ctx_for(tmp_path)
    assert run(ctx, "gpu_xid").status == "passed"
    bad = run(ctx_for(tmp_path, "xid:79"), "gpu_xid")
    assert bad.status == "failed" and bad.value == 1 and "Xid 79 (GPU has fallen off the bus)" in bad.detail
    assert bad.data["hardware"][0]["xid"] == 79
    app = run(ctx_for(tmp_path, "xid:31"), "gpu_xid")
    assert app.status == "passed" and "recorded, not failing: Xid 31" in app.detail
    nvlink = run(ctx_for(tmp_path, "xid:74"), "gpu_xid")
    assert nvlink.status == "failed" and "NVLink" in nvlink.detail
    gone = run(with_probe(ctx, kernel=KernelLogUnavailable("cannot open /dev/kmsg: Permission denied")), "gpu_xid")
    assert gone.status == "skipped" and "Permission denied" in gone.detail


def test_a_fault_appears_at_its_time(tmp_path):
    clock = Clock()
    ctx = ctx_for(tmp_path, "xid:79@30", clock=clock)
    assert run(ctx, "gpu_xid").status == "passed"
    clock.t += 29.9
    assert run(ctx, "gpu_xid").status == "passed"
    clock.t += 0.2
    assert run(ctx, "gpu_xid").status == "failed"


# -- torch-backed checks (fake figures here; the real bench below) -------------------------------
def test_gemm_pass_fail_skip(tmp_path):
    assert run(ctx_for(tmp_path), "gemm_tflops").status == "passed"
    slow = run(ctx_for(tmp_path, "slow-gemm"), "gemm_tflops")
    assert slow.status == "failed" and slow.value < slow.threshold and slow.unit == "TFLOPS"
    busy = run(ctx_for(tmp_path, busy_gpus=lambda: set(range(8))), "gemm_tflops")
    assert busy.status == "skipped" and "in use" in busy.detail
    odd = [GpuInfo(index=0, uuid="u", model="Mystery GPU 9000", memory_total_mib=1000)]
    unknown = run(dataclasses.replace(ctx_for(tmp_path), inventory=odd, probe=FakeProbe(odd)), "gemm_tflops")
    assert unknown.status == "skipped" and "no expected TFLOPS" in unknown.detail


def test_only_idle_gpus_are_burned(tmp_path):
    r = run(ctx_for(tmp_path, busy_gpus=lambda: {0, 1}), "gemm_tflops")
    assert r.status == "passed" and sorted(r.data["per_gpu"]) == [str(i) for i in range(2, 8)]


class BenchSays:
    def __init__(self, **values):  # noqa: ANN003
        self.values = values

    def run(self, kind, gpus, timeout_s):  # noqa: ANN001, ANN201
        v = self.values[kind]
        if isinstance(v, Exception):
            raise v
        return {"value": v, "data": {}}


@pytest.mark.parametrize(("name", "kind", "good", "bad"), [
    ("gpu_memtest", "memtest", 0, 16),
    ("gpu_mem_bw", "device_bw", 1400.0, 300.0),
    ("h2d_bw", "h2d", 25.0, 3.0),
    ("nccl_allreduce", "allreduce", 40.0, 2.0),
    ("p2p_bw", "p2p", 20.0, 1.0),
])
def test_bandwidth_and_memory_checks_pass_and_fail_on_their_threshold(tmp_path, name, kind, good, bad):
    ctx = ctx_for(tmp_path)
    ok = run(dataclasses.replace(ctx, bench=BenchSays(**{kind: good})), name)
    ko = run(dataclasses.replace(ctx, bench=BenchSays(**{kind: bad})), name)
    assert (ok.status, ko.status) == ("passed", "failed")
    assert ko.value == bad and ko.threshold is not None
    skip = run(dataclasses.replace(ctx, bench=BenchSays(**{kind: Skip("torch is not installed on this node")})), name)
    assert skip.status == "skipped" and skip.detail == "torch is not installed on this node"


class BenchLinked:
    """A bench that reports a value and how the GPUs are linked (as torch_bench does)."""

    def __init__(self, value: float, link: dict):
        self.value, self.link = value, link

    def run(self, kind, gpus, timeout_s):  # noqa: ANN001, ANN201
        return {"value": self.value, "data": {"link": self.link}}


@pytest.mark.parametrize(("name", "kind"), [("nccl_allreduce", "allreduce"), ("p2p_bw", "p2p")])
def test_multi_gpu_thresholds_follow_how_the_gpus_are_linked(tmp_path, name, kind):
    """NVLink peers: an absolute floor (GPU-to-GPU copy: the public H100/H200 acceptance figure
    of 335 GB/s); PCIe only: a fraction of the link's rate, derived from its generation and
    width and said in the detail; a link NVML cannot tell: the flat floors."""
    ctx = ctx_for(tmp_path)
    t = ctx.thresholds

    def check(value: float, link: dict):  # noqa: ANN202
        return run(dataclasses.replace(ctx, bench=BenchLinked(value, link)), name)

    nvlink = {"kind": "nvlink", "active_links": {"0": 18, "1": 18}}
    floor = t.allreduce_nvlink_min_gbps if kind == "allreduce" else t.p2p_nvlink_min_gbps
    assert (kind, floor) in (("allreduce", 200.0), ("p2p", 335.0))
    ok, ko = check(floor + 1, nvlink), check(floor - 1, nvlink)
    assert (ok.status, ko.status) == ("passed", "failed") and ok.threshold == ko.threshold == floor
    assert "NVLink peers" in ok.detail
    pcie = {"kind": "pcie", "gen": 5, "width": 16, "gbps": 63.0}
    frac = t.allreduce_pcie_fraction if kind == "allreduce" else t.p2p_pcie_fraction
    want = round(frac * 63.0, 1)
    ok, ko = check(want + 0.5, pcie), check(want - 0.5, pcie)
    assert (ok.status, ko.status) == ("passed", "failed") and ok.threshold == want
    assert "PCIe only" in ok.detail and "gen5 x16" in ok.detail
    unknown = check(1.0, {"kind": "unknown", "why": "NVML: driver not loaded"})
    assert unknown.threshold == (t.allreduce_min_gbps if kind == "allreduce" else t.p2p_min_gbps)
    assert unknown.status == "failed" and "not known" in unknown.detail


def test_the_link_without_a_driver_is_unknown_with_why():
    """Without an NVIDIA driver NVML does not start: the link is reported unknown, with NVML's
    reason (the checks then use the flat floors)."""
    from hai.agent.validators import torch_bench

    assert torch_bench.link([0])["kind"] == "none"  # one GPU: no pair to link
    got = torch_bench.link([0, 1])
    if got["kind"] != "unknown":
        pytest.skip(f"this machine has an NVIDIA driver: {got}")
    assert got["why"].startswith(("NVML", "nvidia-ml-py"))


@pytest.mark.parametrize("name", ["nccl_allreduce", "p2p_bw"])
def test_multi_gpu_checks_skip_on_a_one_gpu_node(tmp_path, name):
    r = run(ctx_for(tmp_path, gpus=1), name)
    assert r.status == "skipped" and "one GPU" in r.detail


def test_torch_bench_without_cuda_says_skipped_with_why(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the bench would measure")
    ctx = dataclasses.replace(ctx_for(tmp_path, gpus=1), bench=TorchBench(burn_s=0.1))
    for name in ("gemm_tflops", "gpu_memtest", "gpu_mem_bw", "h2d_bw"):
        r = run(ctx, name)
        assert r.status == "skipped", r
        assert "no CUDA device" in r.detail and torch.__version__ in r.detail


# -- host checks ---------------------------------------------------------------------------
def _ib(tmp_path, state: str, rate: str) -> None:
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True, exist_ok=True)
    (port / "state").write_text(state + "\n")
    (port / "rate").write_text(rate + "\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text("InfiniBand\n")


def test_ib_ports_pass_fail_skip(tmp_path):
    assert run(ctx_for(tmp_path), "ib_ports").status == "skipped"
    _ib(tmp_path, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    ok = run(ctx_for(tmp_path), "ib_ports")
    assert (ok.status, ok.value) == ("passed", 200.0)
    _ib(tmp_path, "1: DOWN", "10 Gb/sec (4X SDR)")
    down = run(ctx_for(tmp_path), "ib_ports")
    assert down.status == "failed" and "mlx5_0/1 is 1: DOWN" in down.detail
    _ib(tmp_path, "4: ACTIVE", "56 Gb/sec (4X FDR)")
    slow = run(ctx_for(tmp_path), "ib_ports")
    assert slow.status == "failed" and "56 Gb/s" in slow.detail


@pytest.mark.parametrize(("name", "field"), [("ckpt_free_space", "ckpt_min_free_gib"),
                                             ("ckpt_write_bw", "ckpt_min_write_mbps"),
                                             ("host_mem_bw", "host_mem_min_gbps")])
def test_host_checks_pass_and_fail_on_their_threshold(tmp_path, name, field):
    ctx = ctx_for(tmp_path)
    assert run(ctx, name).status == "passed"
    strict = dataclasses.replace(ctx, thresholds=dataclasses.replace(ctx.thresholds, **{field: 1e12}))
    r = run(strict, name)
    assert r.status == "failed" and r.value < r.threshold
    assert not list((tmp_path / "ckpt").glob(".hai-validate-*"))  # the probe file is removed


def test_thresholds_from_the_environment(monkeypatch):
    monkeypatch.setenv("HAI_VALIDATOR_GEMM_FRACTION", "0.8")
    assert Thresholds.from_env().gemm_fraction == 0.8 and Thresholds.from_env().p2p_min_gbps == 5.0


def test_expected_figures_pick_the_most_specific_model():
    assert expected_for("NVIDIA H200") == (989.0, 4800.0)
    assert expected_for("NVIDIA H200 NVL") == (835.0, 4800.0)
    assert expected_for("NVIDIA A100-SXM4-80GB")[1] == 2039.0
    assert expected_for("HAI Fake A100-PCIE-40GB") == (312.0, 1555.0)
    assert expected_for("Mystery") is None


# -- the runner ----------------------------------------------------------------------------
def test_a_check_that_hangs_fails_on_its_timeout_and_one_that_breaks_fails_with_why(tmp_path):
    ctx = ctx_for(tmp_path)
    release = threading.Event()

    def hang(_ctx, _c):  # noqa: ANN001, ANN202
        release.wait(10)

    def boom(_ctx, _c):  # noqa: ANN001, ANN202
        raise OSError("device busy")

    slow = run_check(ctx, Check("hang", "quick", True, 0.2, hang))
    release.set()
    assert slow.status == "failed" and "did not finish within 0.2s" in slow.detail
    broke = run_check(ctx, Check("boom", "quick", True, 5, boom))
    assert broke.status == "failed" and broke.detail == "OSError: device busy"


def test_the_runner_runs_each_run_once_and_keeps_reports_until_acknowledged(tmp_path):
    done = threading.Event()
    v = Validator(ctx_for(tmp_path), on_done=done.set)
    req = ValidationRequest(run_id=7, level="quick")
    v.submit([req])
    v.submit([req])  # the same request in the next reply
    assert done.wait(30)
    deadline = time.monotonic() + 10
    while v.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    (rep,) = v.reports()
    assert rep.run_id == 7 and {c.name for c in rep.checks} == {c.name for c in checks_for("quick")}
    v.submit([req])
    assert v.runs == 1
    v.acknowledge([rep], [req])  # still listed: not delivered yet
    assert [r.run_id for r in v.reports()] == [7]
    v.acknowledge([rep], [])
    assert v.reports() == [] and v.runs == 1


def test_the_runner_runs_own_rounds_one_at_a_time_and_drops_each_once_a_reply_came(tmp_path):
    """Issue 12 (protocol version 2): a periodic quick round of the agent's own has no run id; it
    does not start while a run is under way; its report goes in every heartbeat until a reply to
    one that carried it came, whatever that reply lists."""
    done = threading.Event()
    gate = threading.Event()
    v = Validator(ctx_for(tmp_path), on_done=done.set)
    real = v.ctx.probe.kernel_lines

    def held():  # noqa: ANN202 - the first round waits here until the test lets it go
        gate.wait(10)
        return real()

    v.ctx.probe.kernel_lines = held
    assert v.own_round([])
    assert v.busy() and not v.own_round([])  # one at a time
    v.submit([ValidationRequest(run_id=9, level="quick")])  # a requested run queues behind it
    gate.set()
    wait_for(lambda: v.runs == 2 and not v.busy(), timeout=30, what="both runs")
    reports = v.reports()
    assert [r.run_id for r in reports] == [9, None]
    own = reports[1]
    assert own.level == "quick" and own.started_at <= own.finished_at
    assert {c.name for c in own.checks} == {c.name for c in checks_for("quick")}
    v.acknowledge([own], [ValidationRequest(run_id=9, level="quick")])  # the reply still lists 9
    assert [r.run_id for r in v.reports()] == [9]
    assert v.own_round([])
    wait_for(lambda: v.runs == 3 and not v.busy(), timeout=30, what="the second own round")
    later = [r for r in v.reports() if r.run_id is None]
    assert len(later) == 1 and later[0].started_at > own.started_at
    v.acknowledge([], [])  # a reply to a heartbeat that did not carry it: kept
    assert len(v.reports()) == 2


def test_the_runner_checks_against_the_servers_inventory(tmp_path):
    done = threading.Event()
    v = Validator(ctx_for(tmp_path), on_done=done.set)
    registered = FakeGpus(9, node="n").inventory()  # the server knows 9 GPUs; 8 answer
    v.submit([ValidationRequest(run_id=1, level="quick", expected_gpus=registered)])
    assert done.wait(30)
    inv = next(c for c in v.reports()[0].checks if c.name == "gpu_inventory")
    assert inv.status == "failed" and (inv.value, inv.threshold) == (8, 9)


# -- fault specs ---------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "fault"), [
    ("xid:79", Fault("xid", 0.0, 79)), ("xid:74@12", Fault("xid", 12.0, 74)), ("ecc", Fault("ecc")),
    ("gpu-missing@5.5", Fault("gpu-missing", 5.5)), ("slow-gemm@0", Fault("slow-gemm", 0.0)),
])
def test_fault_specs(spec, fault):
    assert parse_fault(spec) == fault


@pytest.mark.parametrize("spec", ["", "xid", "xid:", "xid:79@", "fire", "ecc@-1", "ecc@soon", "xid:1234"])
def test_bad_fault_specs_are_refused(spec):
    with pytest.raises(BadFaultSpec, match="KIND"):
        parse_fault(spec)


def test_gpu_missing_kills_the_ranks_on_that_gpu_once_when_it_appears():
    import subprocess

    clock = Clock()
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        effects = FaultEffects(FaultPlan.parse(["gpu-missing@5"], clock=clock), gpu=7,
                               pids_on=lambda g: [proc.pid] if g == 7 else [])
        assert effects.tick() is False and proc.poll() is None  # not yet
        clock.t += 5
        assert effects.tick() is True
        assert proc.wait(10) == -9
        assert effects.tick() is False  # once
    finally:
        if proc.poll() is None:
            proc.kill()
