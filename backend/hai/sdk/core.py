"""The job side of the checkpoint handshake. Stdlib only.

The channel is the attempt's control directory ``HAI_CONTROL_DIR`` (made by the agent):

- agent -> job: the agent creates ``<control>/suspend`` (JSON: requested_at, grace_s) to ask the
  job to checkpoint and stop; ``should_suspend()`` looks for it (one ``stat``).
- job -> agent: each rank appends JSON lines to ``<control>/events.<RANK>.jsonl`` (one ``write``
  per event, O_APPEND): ``{"type": "checkpoint", "path", "step", "at", "duration_s"}``,
  ``{"type": "progress", "step", "total", "metrics", "at"}``, ``{"type": "suspend_ready", "at"}``.
  The agent tails them and reports in its heartbeats.

Outside the platform (no HAI_CONTROL_DIR) every call is a harmless no-op.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any

SUSPEND_FILE = "suspend"

_lock = threading.Lock()


class _State:
    def __init__(self) -> None:
        self.calls = 0
        self.latched = False
        self.pending: Any = None  # async collective of the previous check (work, tensor)
        self.next_check = 1  # call number of the next check point (distributed)
        self.last_check_mono: float | None = None
        self.last_check_call = 0
        self.group: Any = None  # the CPU (gloo) process group the flag travels on
        self.group_for: Any = None  # the default group it was made for
        self.progress_last_write: float | None = None
        self.progress_pending: dict | None = None
        self.checkpoint_started: float | None = None


_state = _State()


def _reset() -> None:
    """Forget the per-process state (tests)."""
    global _state
    _state = _State()


def control_dir() -> str | None:
    """The attempt's control directory, or None outside the platform."""
    d = os.environ.get("HAI_CONTROL_DIR")
    return d or None


def on_platform() -> bool:
    return control_dir() is not None


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _emit(event: dict, *, tell: bool = True) -> None:
    """Append one event for the agent. A full control folder (ENOSPC/EDQUOT, issue 13) raises
    :class:`StorageFull` when ``tell`` (the platform did not get a checkpoint or a suspend_ready:
    the job should know); progress reports (``tell=False``) are dropped instead."""
    d = control_dir()
    if d is None:
        return
    event.setdefault("at", time.time())
    event.setdefault("rank", _rank())
    event.setdefault("pid", os.getpid())
    data = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
    try:
        fd = os.open(os.path.join(d, f"events.{_rank()}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return  # the agent's folder vanished: nothing to report to
    try:
        os.write(fd, data)
    except OSError as e:
        if e.errno not in _FULL_ERRNOS:
            raise
        if tell:
            raise StorageFull(e.errno, f"no space left to tell the platform ({event.get('type')}): "
                              f"{e.strerror}", d) from e
    finally:
        os.close(fd)


# ------------------------------------------------------------------ torch.distributed helpers


def _dist():
    """torch.distributed when it is already imported AND initialised with world_size > 1."""
    mod = sys.modules.get("torch.distributed")
    if mod is None:
        return None
    try:
        if mod.is_available() and mod.is_initialized() and mod.get_world_size() > 1:
            return mod
    except Exception:
        return None
    return None


def _flag_group(dist):
    """A CPU (gloo) group for the suspend flag, so checking it never syncs a CUDA stream.
    Created on first use — a collective call, so every rank must make the same SDK calls."""
    default = dist.group.WORLD
    if _state.group is None or _state.group_for is not default:
        # its own group even when the default one is gloo: the flag never queues behind gradients
        _state.group = dist.new_group(backend="gloo")
        _state.group_for = default
        # after torch's own exit handlers, so it runs before them (a second one finds nothing)
        atexit.register(_settle_at_exit)
    return _state.group


def _local_flag() -> bool:
    d = control_dir()
    return d is not None and os.path.exists(os.path.join(d, SUSPEND_FILE))


def suspend_requested() -> bool:
    """This node's agent asked for a suspend (no collective: ranks may differ for a moment).
    Use ``should_suspend()`` in training loops."""
    return _local_flag()


def _env_int(name: str) -> int | None:
    try:
        v = os.environ.get(name)
        return int(v) if v else None
    except ValueError:
        return None


def _check_interval_s() -> float:
    try:
        return float(os.environ.get("HAI_SUSPEND_CHECK_INTERVAL_S", "0.2"))
    except ValueError:
        return 0.2


MAX_CHECK_EVERY = 10_000


def should_suspend(*, every: int | None = None, sync: bool = True) -> bool:
    """True when the platform asks the job to checkpoint and stop. Cheap: call it every step.

    In a torch.distributed job (torch.distributed imported and initialised) every rank gets the
    same answer at the same step. At check points the ranks start a small asynchronous
    all-reduce (MAX) of their local flag on a CPU (gloo) group and read the previous check
    point's result, so no CUDA stream is synchronised and nobody waits on the network; the
    request of any node's agent stops every rank. Check points are spaced to about
    HAI_SUSPEND_CHECK_INTERVAL_S (0.2 s) of training: the spacing travels in the same all-reduce,
    so every rank uses the same one. ``every``: a fixed spacing of N calls instead (or env
    HAI_SUSPEND_CHECK_EVERY). Call it on EVERY rank, the same number of times.
    ``sync=False``: no collective (this rank's own view only).
    Once True it stays True. Outside the platform: always False, no collective.
    """
    if control_dir() is None:
        return False
    st = _state
    if st.latched:
        return True
    st.calls += 1
    fixed = every if every is not None else _env_int("HAI_SUSPEND_CHECK_EVERY")
    dist = _dist() if sync else None
    if dist is None:
        if fixed is not None and fixed > 1 and (st.calls - 1) % fixed:
            return False
        if _local_flag():  # one stat(): cheap enough for every call
            st.latched = True
        return st.latched
    if st.calls < st.next_check:
        return False
    import torch  # torch.distributed is initialised, so torch is importable

    group = _flag_group(dist)
    interval = 1
    if st.pending is not None:
        work, tensor = st.pending
        work.wait()
        flag, interval = int(tensor[0]), int(tensor[1])
        st.pending = None
        if flag > 0:
            st.latched = True
            return True
    now = time.monotonic()
    if fixed is not None:
        proposal = max(1, fixed)
    elif st.last_check_mono is not None and st.calls > st.last_check_call:
        per_call = (now - st.last_check_mono) / (st.calls - st.last_check_call)
        proposal = int(_check_interval_s() / per_call) if per_call > 0 else MAX_CHECK_EVERY
        proposal = max(1, min(MAX_CHECK_EVERY, proposal))
    else:
        proposal = 1
    tensor = torch.tensor([1 if _local_flag() else 0, proposal], dtype=torch.int64)
    st.pending = (dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True), tensor)
    # ``interval`` is the previous all-reduce's result: the same on every rank
    st.next_check = st.calls + max(1, fixed if fixed is not None else interval)
    st.last_check_mono, st.last_check_call = now, st.calls
    return False


EXIT_WAIT_S = 10.0


def _settle_at_exit() -> None:
    """At interpreter exit: let the last flag all-reduce finish while Python is fully alive.

    The last check point's collective is usually still in flight when a training loop ends (its
    result is read at the next check, which never comes), and destroy_process_group() does not
    wait for it. When the peer's half then arrives while this process is being torn down, the
    rank can abort in gloo's worker thread ("terminate called without an active exception",
    exit 134: seen in the DDP example test, reproduced by a peer that answers ~0.1 s late). So:
    wait for it (every rank issued it, so the peers answer promptly; bounded in case one is
    gone), and keep the work and its tensor referenced for the rest of the process, so that no
    thread has to hand them back to Python during the teardown.

    Then the SDK lets go of its group, so that a group already destroyed is freed here, its worker
    threads joined once they have let go of their last work (which may take the GIL), not during
    the teardown, where a thread that takes the GIL is killed inside a destructor and the rank
    aborts the same way (seen with DDP's last gradient all-reduce: ``examples/haiscale_ddp.py``).
    Not when the check did not complete: a thread may still wait for the peer."""
    st = _state
    pending, st.pending = st.pending, None
    if pending is not None:
        for obj in pending:  # an extra reference that finalisation does not take back
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        try:
            import datetime

            pending[0].wait(datetime.timedelta(seconds=EXIT_WAIT_S))
        except Exception as e:  # a peer already gone, or it never made the matching call
            print(f"[hai.sdk] the last suspend check did not complete at exit: {e}", file=sys.stderr)
            return
    st.group = st.group_for = None


def _barrier_all() -> None:
    """A barrier over every rank on the SDK's CPU group (no-op when not distributed)."""
    dist = _dist()
    if dist is None:
        return
    st = _state
    if st.pending is not None:  # finish the flag collective first: keep the call sequence aligned
        st.pending[0].wait()
        st.pending = None
    dist.barrier(group=_flag_group(dist))


barrier = _barrier_all


def suspend_ready(*, barrier: bool = True) -> None:
    """The job's checkpoint is safe: the platform may stop it now.

    Call it on every rank after the checkpoint is written. In a torch.distributed job it first
    waits for every rank (a barrier on the SDK's CPU group), so no rank is stopped while another
    is still writing; pass ``barrier=False`` when only some ranks call it."""
    if control_dir() is None:
        return
    if barrier:
        _barrier_all()
    _emit({"type": "suspend_ready"})


def resume_path() -> str | None:
    """The checkpoint to resume from (HAI_RESUME_FROM) when this attempt is a resume, else None."""
    p = os.environ.get("HAI_RESUME_FROM")
    return p or None


def checkpoint_dir() -> str | None:
    """The job's checkpoint folder (HAI_CHECKPOINT_DIR; it outlives attempts), or None."""
    p = os.environ.get("HAI_CHECKPOINT_DIR")
    return p or None


def report_checkpoint(path: str, step: int | None = None, *, duration_s: float | None = None) -> None:
    """Record the job's latest safe checkpoint (the platform resumes from it). ``duration_s``
    (how long saving took; the scheduler uses it) defaults to the time since ``checkpointing()``
    was entered, when it was used."""
    if control_dir() is None:
        return
    if duration_s is None and _state.checkpoint_started is not None:
        duration_s = time.time() - _state.checkpoint_started
    _emit({"type": "checkpoint", "path": os.path.abspath(path), "step": step,
           "duration_s": round(duration_s, 6) if duration_s is not None else None})


@contextmanager
def checkpointing():
    """Times a checkpoint: ``with checkpointing(): save(...); report_checkpoint(path, step)``."""
    _state.checkpoint_started = time.time()
    try:
        yield
    finally:
        _state.checkpoint_started = None


def _progress_interval() -> float:
    try:
        return float(os.environ.get("HAI_PROGRESS_INTERVAL_S", "1.0"))
    except ValueError:
        return 1.0


def _flush_progress() -> None:
    with _lock:
        ev = _state.progress_pending
        _state.progress_pending = None
    if ev is not None:
        try:
            _emit(ev, tell=False)
        except OSError:
            pass


atexit.register(_flush_progress)


def report_progress(step: int, total: int | None = None, **metrics: float) -> None:
    """Report training progress (shown with the job). Cheap to call every step: written at most
    every HAI_PROGRESS_INTERVAL_S (1 s), the last one at exit or when step == total."""
    if control_dir() is None:
        return
    ev = {"type": "progress", "step": int(step), "total": total, "at": time.time(),
          "metrics": {k: float(v) for k, v in metrics.items()}}
    now = time.monotonic()
    with _lock:
        last = _state.progress_last_write
        due = last is None or now - last >= _progress_interval() or (total is not None and step >= total)
        if not due:
            _state.progress_pending = ev
            return
        _state.progress_last_write = now
        _state.progress_pending = None
    _emit(ev, tell=False)


# ------------------------------------------------------------------ storage errors (issue 13)


class StorageFull(OSError):
    """A write to the job's checkpoint or log folder failed because its filesystem is full (or
    over quota). The platform has been told (a job event); the job decides: skip this checkpoint
    and go on, free space, or exit. Raised by :func:`storage` and by CheckpointManager.wait(),
    and by :func:`report_checkpoint` / :func:`suspend_ready` when the node's folder for the
    SDK's events is full (the platform did not get that report)."""


_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def report_storage_full(path: str, error: BaseException | str) -> None:
    """Tell the platform that writing ``path`` failed for lack of space (the node agent records
    it as a job event). Called by :func:`storage`; a no-op outside the platform."""
    try:
        _emit({"type": "storage_full", "path": os.path.abspath(path), "error": str(error)[:500]}, tell=False)
    except OSError:
        pass  # the agent's folder is full too: the error still reaches the job


@contextmanager
def storage(path: str):
    """Wrap writes under the job's checkpoint (or log) folder:

        try:
            with sdk.storage(path):
                save(path)
        except sdk.StorageFull:
            ...  # the platform knows; skip this checkpoint, or free space

    ENOSPC/EDQUOT becomes :class:`StorageFull` (the platform is told once per call); any other
    error goes through unchanged."""
    try:
        yield
    except StorageFull:
        raise
    except OSError as e:
        if e.errno not in _FULL_ERRNOS:
            raise
        report_storage_full(path, e)
        raise StorageFull(e.errno, f"no space left to write {path}: {e.strerror}", path) from e
