"""Runs one rank inside its container and bridges the job SDK's control directory (stdlib only).

The SDK (``hai.sdk``) is unchanged: it looks for ``$HAI_CONTROL_DIR/suspend`` and appends its
events to ``$HAI_CONTROL_DIR/events.<RANK>.jsonl``, exactly as under the node agent. In a pod:

- platform -> job: the backend sets the pod annotation ``hai.io/suspend`` (JSON requested_at,
  grace_s); a downwardAPI volume projects it into ``$HAI_PODINFO_DIR/suspend`` and this wrapper
  turns a non-empty file into ``$HAI_CONTROL_DIR/suspend`` (an emptyDir shared by the pod's
  containers) and an empty one back into no file.
- job -> platform: this wrapper tails the rank's events file and writes each event to the
  container's stdout as one line ``EVENT_PREFIX + json``; the backend follows the pod's log and
  takes those lines out of the log stream.

hfreduce ranks (``--bind numa``), as the agent's launcher binds them: the wrapper finds the
container's GPU (``NVIDIA_VISIBLE_DEVICES`` as the device plugin sets it, a UUID or an index, in
``/proc/driver/nvidia/gpus/*/information``), binds the command to the CPUs of that GPU's NUMA
node (those of them the container may use) and sets ``HAI_NUMA_NODE`` and, where the node has
InfiniBand, ``HAI_NIC`` and ``NCCL_IB_HCA`` (unless the job set it) to that NUMA node's HCA.

The command runs as a child in the wrapper's process group (the container's); SIGTERM/SIGINT
sent to the wrapper (PID 1 of the container) are passed on to it; the wrapper exits with the command's code (128 + N for a signal N), so the container's
exit code is the rank's.

    python -m hai.integrations.kubernetes.podwrap -- python train.py ...
    python -m hai.integrations.kubernetes.podwrap --bind numa -- python train.py ...   (hfreduce)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

EVENT_PREFIX = "\x1ehai-event "
SUSPEND_FILE = "suspend"
POLL_S = 0.1


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class Bridge:
    def __init__(self, control: str, podinfo: str | None, rank: str, out=None) -> None:
        self.control = control
        self.podinfo = podinfo
        self.events = os.path.join(control, f"events.{rank}.jsonl")
        self.offset = 0
        self.out = out if out is not None else sys.stdout.buffer
        self.lock = threading.Lock()

    def sync_suspend(self) -> None:
        if not self.podinfo:
            return
        raw = _read(os.path.join(self.podinfo, SUSPEND_FILE))
        target = os.path.join(self.control, SUSPEND_FILE)
        wanted = False
        if raw and raw != "null":
            try:
                wanted = isinstance(json.loads(raw), dict)
            except ValueError:
                wanted = False
        if wanted and not os.path.exists(target):
            _write_atomic(target, raw)
        elif not wanted and os.path.exists(target):
            try:
                os.unlink(target)
            except OSError:
                pass

    def ship_events(self) -> None:
        with self.lock:
            try:
                with open(self.events, "rb") as f:
                    f.seek(self.offset)
                    data = f.read()
            except OSError:
                return
            end = data.rfind(b"\n")
            if end < 0:
                return
            self.offset += end + 1
            for raw in data[: end + 1].splitlines():
                if raw.strip():
                    # one write per line (< PIPE_BUF): never torn by the rank's own output
                    self.out.write(EVENT_PREFIX.encode() + raw.strip() + b"\n")
            self.out.flush()

    def round(self) -> None:
        self.sync_suspend()
        self.ship_events()


def numa_binding(environ: dict[str, str], *, sysfs: str = "/sys", procfs: str = "/proc",
                 ) -> tuple[dict[str, str], list[int] | None]:
    """(environment to add, CPUs to bind to) for an hfreduce rank whose container holds one GPU."""
    import hai.agent.topology as topology  # stdlib only, like this module

    visible = environ.get("NVIDIA_VISIBLE_DEVICES") or environ.get("CUDA_VISIBLE_DEVICES") or ""
    wanted = [v.strip() for v in visible.split(",") if v.strip() and v.strip() not in ("all", "none", "void")]
    gpus = topology.nvidia_gpus(procfs)
    bus = None
    if wanted:
        w = wanted[0]
        bus = next((b for b, uuid, minor in gpus if w == uuid or (w.isdigit() and minor == int(w))), None)
    if bus is None and len(gpus) == 1:
        bus = gpus[0][0]  # the container sees its own GPU only
    numa = topology.pci_numa_node(bus, sysfs) if bus else None
    env: dict[str, str] = {}
    cpus = None
    if numa is not None:
        env["HAI_NUMA_NODE"] = str(numa)
        cpus = topology.numa_cpus(numa, sysfs)
    nic = topology.nic_for(numa, topology.ib_devices(sysfs))
    if nic:
        env["HAI_NIC"] = nic
        if "NCCL_IB_HCA" not in environ:
            env["NCCL_IB_HCA"] = nic
    return env, cpus


def _options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    while argv and argv[0] in ("--bind", "--sysfs", "--procfs") and len(argv) >= 2:
        opts[argv[0][2:]] = argv[1]
        argv = argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    return opts, argv


def main(argv: list[str] | None = None) -> int:
    opts, argv = _options(list(sys.argv[1:] if argv is None else argv))
    if not argv:
        print("podwrap: no command", file=sys.stderr)
        return 2
    env = None
    if opts.get("bind") == "numa":
        extra, cpus = numa_binding(dict(os.environ), sysfs=opts.get("sysfs", "/sys"),
                                   procfs=opts.get("procfs", "/proc"))
        env = {**os.environ, **extra}
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)  # inherited by the command
            except OSError as e:
                print(f"podwrap: could not bind to CPUs {cpus}: {e}", file=sys.stderr, flush=True)
        print(f"podwrap: NUMA binding: node {extra.get('HAI_NUMA_NODE', 'unknown')}, CPUs {cpus or 'all'}, "
              f"NIC {extra.get('HAI_NIC', 'none')}", file=sys.stderr, flush=True)
    elif opts.get("bind"):
        print(f"podwrap: unknown --bind {opts['bind']!r} (known: numa)", file=sys.stderr)
        return 2
    control = os.environ.get("HAI_CONTROL_DIR")
    bridge = None
    if control:
        os.makedirs(control, exist_ok=True)
        bridge = Bridge(control, os.environ.get("HAI_PODINFO_DIR"), os.environ.get("RANK", "0"))
        bridge.sync_suspend()  # a pod created while its suspend is already requested
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as e:
        print(f"podwrap: cannot start {argv[0]}: {e}", file=sys.stderr)
        return 127

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(POLL_S):
            try:
                bridge.round()
            except Exception as e:  # never let the bridge kill the rank
                print(f"podwrap: {e}", file=sys.stderr)

    t = None
    if bridge is not None:
        t = threading.Thread(target=loop, daemon=True)
        t.start()
    rc = child.wait()
    stop.set()
    if t is not None:
        t.join(2)
        bridge.ship_events()  # the last events (suspend_ready) before the container ends
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main())
