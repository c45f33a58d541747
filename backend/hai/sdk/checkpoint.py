"""CheckpointManager for PyTorch jobs, after the Fire-Flyer paper's checkpoint manager.

``save(state, step)`` takes a host-memory snapshot of the state and returns at once; a
background thread serialises it and writes it in chunks to a temporary file, fsyncs it, renames
it atomically into place (``<prefix>-<step>.pt``), keeps only the last K checkpoints and reports
each one to the platform (``report_checkpoint``). The training loop only pays for the snapshot:

- CUDA tensors are copied into (reused) pinned host buffers on a side CUDA stream; the current
  stream is made to wait for that copy, so the CPU does not block and later kernels cannot
  modify the parameters before they are copied;
- CPU tensors are cloned (a memcpy).

Importing this module needs only the standard library; torch is imported on first use.
"""

from __future__ import annotations

import copy
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from hai.sdk import core

_NAME = re.compile(r"^(?P<prefix>.+)-(?P<step>\d{12})\.pt$")


class _ChunkWriter:
    """A write-only file object for torch.save that writes to ``fd`` in chunks of
    ``chunk_bytes`` (optionally throttled to ``max_bytes_s``)."""

    def __init__(self, fd: int, chunk_bytes: int, max_bytes_s: float | None):
        self.fd = fd
        self.chunk = chunk_bytes
        self.max_bytes_s = max_bytes_s
        self.buf = bytearray()
        self.written = 0
        self.t0 = time.monotonic()

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        self.buf += mv
        while len(self.buf) >= self.chunk:
            self._out(self.chunk)
        return mv.nbytes

    def _out(self, n: int) -> None:
        view = memoryview(self.buf)[:n]
        off = 0
        while off < n:
            off += os.write(self.fd, view[off:])
        view.release()
        del self.buf[:n]
        self.written += n
        if self.max_bytes_s:
            ahead = self.written / self.max_bytes_s - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)

    def flush(self) -> None:
        if self.buf:
            self._out(len(self.buf))


class CheckpointManager:
    """Asynchronous, atomic, keep-last-K checkpoints that are reported to the platform.

    ``directory``: default HAI_CHECKPOINT_DIR (per job, outlives attempts), else ./checkpoints.
    ``writer``: which ranks write — "rank0" (default; data-parallel state is replicated) or
    "all" (each rank its own file, e.g. sharded state; the prefix then gets ``-rank<R>``).
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, keep: int = 3, prefix: str = "ckpt",
                 chunk_mib: int = 64, writer: str = "rank0", report: bool = True,
                 max_write_mib_s: float | None = None):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        if writer not in ("rank0", "all"):
            raise ValueError("writer must be 'rank0' or 'all'")
        self.directory = os.path.abspath(os.fspath(directory or core.checkpoint_dir() or "checkpoints"))
        self.keep = keep
        self.writer = writer
        self.prefix = prefix if writer == "rank0" else f"{prefix}-rank{self.rank}"
        self.chunk_bytes = max(1, int(chunk_mib * (1 << 20)))
        self.max_bytes_s = max_write_mib_s * (1 << 20) if max_write_mib_s else None
        self.report = report
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_path: str | None = None
        self._pinned: list[Any] = []
        self._streams: dict[int, Any] = {}
        self.last_duration_s: float | None = None
        self.last_snapshot_s: float | None = None
        if self.is_writer:
            os.makedirs(self.directory, exist_ok=True)
            self._remove_stale_tmp()

    # ------------------------------------------------------------------ who writes

    @property
    def rank(self) -> int:
        dist = core._dist()
        if dist is not None:
            return dist.get_rank()
        return core._rank()

    @property
    def is_writer(self) -> bool:
        return self.writer == "all" or self.rank == 0

    # ------------------------------------------------------------------ files

    def path_for(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.prefix}-{int(step):012d}.pt")

    def checkpoints(self) -> list[str]:
        """Finished checkpoints of this manager, oldest first."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        found = []
        for n in names:
            m = _NAME.match(n)
            if m and m.group("prefix") == self.prefix:
                found.append((int(m.group("step")), os.path.join(self.directory, n)))
        return [p for _, p in sorted(found)]

    def latest(self) -> str | None:
        c = self.checkpoints()
        return c[-1] if c else None

    def _remove_stale_tmp(self) -> None:
        try:
            for n in os.listdir(self.directory):
                if n.startswith(f".{self.prefix}-") and ".tmp-" in n:
                    try:
                        os.unlink(os.path.join(self.directory, n))
                    except OSError:
                        pass
        except OSError:
            pass

    # ------------------------------------------------------------------ snapshot

    def _snapshot(self, state: Any) -> tuple[Any, Any]:
        """Host copy of ``state``; returns (snapshot, cuda_event or None)."""
        import torch

        tensors: list[Any] = []

        def collect(obj: Any) -> None:
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
            elif isinstance(obj, Mapping):
                for v in obj.values():
                    collect(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    collect(v)

        collect(state)
        cuda = [t for t in tensors if t.is_cuda]
        reuse = len(self._pinned) == len(cuda) and all(
            p.shape == t.shape and p.dtype == t.dtype for p, t in zip(self._pinned, cuda))
        if not reuse:
            self._pinned = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) for t in cuda]
        host: dict[int, Any] = {}
        event = None
        if cuda:
            by_dev: dict[int, list[int]] = {}
            for i, t in enumerate(cuda):
                by_dev.setdefault(t.device.index, []).append(i)
            events = []
            for dev, idxs in by_dev.items():
                with torch.cuda.device(dev):
                    stream = self._streams.get(dev)
                    if stream is None:
                        stream = self._streams[dev] = torch.cuda.Stream(dev)
                    cur = torch.cuda.current_stream(dev)
                    stream.wait_stream(cur)
                    with torch.cuda.stream(stream):
                        for i in idxs:
                            self._pinned[i].copy_(cuda[i].detach(), non_blocking=True)
                    # later kernels on the training stream wait for the copy (the CPU does not)
                    cur.wait_stream(stream)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events.append(ev)
            event = events
            for i, t in enumerate(cuda):
                host[id(t)] = self._pinned[i]
        for t in tensors:
            if not t.is_cuda and id(t) not in host:
                host[id(t)] = t.detach().clone()

        def build(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return host[id(obj)]
            if isinstance(obj, Mapping):
                out = {k: build(v) for k, v in obj.items()}
                try:
                    return type(obj)(out)  # keep OrderedDict & co.
                except Exception:
                    return out
            if isinstance(obj, list):
                return [build(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(build(v) for v in obj)
            return copy.deepcopy(obj)

        return build(state), event

    # ------------------------------------------------------------------ save

    def save(self, state: Any, step: int, *, blocking: bool = False) -> str | None:
        """Checkpoint ``state`` (a dict of tensors, state_dicts, plain values) as of ``step``.

        Returns the path it will have (None on ranks that do not write). Waits for the previous
        save first; ``blocking=True`` also waits for this one to be durable and reported."""
        if not self.is_writer:
            return None
        self.wait()
        t0 = time.time()
        snap, events = self._snapshot(state)
        self.last_snapshot_s = time.time() - t0
        path = self.path_for(step)
        self._error = None
        self._thread = threading.Thread(target=self._write, args=(snap, events, path, step, t0),
                                        name="hai-checkpoint-writer", daemon=False)
        self._thread.start()
        if blocking:
            self.wait()
        return path

    def _write(self, snap: Any, events: Any, path: str, step: int, t0: float) -> None:
        import torch

        try:
            for ev in events or []:
                ev.synchronize()
            tmp = os.path.join(self.directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                w = _ChunkWriter(fd, self.chunk_bytes, self.max_bytes_s)
                torch.save(snap, w)
                w.flush()
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            dfd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self.last_duration_s = time.time() - t0
            self._last_path = path
            self._prune(path)
            if self.report:
                core.report_checkpoint(path, step, duration_s=self.last_duration_s)
        except BaseException as e:  # surfaced by wait()
            if isinstance(e, OSError) and e.errno in core._FULL_ERRNOS:  # issue 13: the platform is told
                core.report_storage_full(path, e)
                e = core.StorageFull(e.errno, f"no space left to write {path}: {e.strerror}", path)
            self._error = e
            try:
                os.unlink(tmp)  # type: ignore[possibly-undefined]
            except Exception:
                pass

    def _prune(self, just_written: str) -> None:
        ckpts = self.checkpoints()
        for p in ckpts[: max(0, len(ckpts) - self.keep)]:
            if p != just_written:
                try:
                    os.unlink(p)
                except OSError:
                    pass

    def wait(self) -> str | None:
        """Wait for the save in flight; returns the latest written path. Re-raises its error:
        :class:`hai.sdk.StorageFull` when the folder is full (the platform has been told), else
        a RuntimeError."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, core.StorageFull):
                raise e
            raise RuntimeError(f"checkpoint write failed: {e}") from e
        return self._last_path

    # ------------------------------------------------------------------ load

    def resume_path(self) -> str | None:
        """HAI_RESUME_FROM when the platform resumes this job, else None."""
        return core.resume_path()

    def load(self, path: str | None = None, *, map_location: Any = "cpu", fallback_latest: bool = False) -> Any:
        """Load ``path`` (default: ``resume_path()``; with ``fallback_latest`` the newest file in
        the directory when there is none). Returns None when there is nothing to resume."""
        import torch

        path = path or self.resume_path() or (self.latest() if fallback_latest else None)
        if not path:
            return None
        return torch.load(path, map_location=map_location, weights_only=False)
