"""Log capture and shipping.

Each rank's wrapper (rankwrap.py) copies the rank's stdout/stderr into files in the attempt's
folder (so they never depend on the agent; on a full folder the output is dropped with a marker,
never the rank).
A tailer reads new complete lines from those files (persisting read offsets and the per-rank
``seq`` counter, so an agent restart continues where it stopped) and offers them to a BOUNDED
buffer; the shipper drains the buffer in batches to the server. A job is never blocked by log
shipping: when the buffer is full, lines are dropped and counted, and the count is announced
in-band as a ``system`` line ``[hai] N lines dropped (log buffer full)`` in the same sequence.

A line read but not yet shipped is kept on disk too, with its seq (``AttemptTail.journal``,
beside the offsets), until the shipper delivered it: an agent killed in between offers it again
after its restart under the same seq, and the server keeps one copy of each (job, attempt,
rank, seq). Before, the offsets moved past a line as soon as it was read, and a line still in
the buffer when the agent died was lost.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter

from hai.protocol import LogLine

log = logging.getLogger("hai.agent.logs")

_RANK = attrgetter("rank")
_SEQ = attrgetter("seq")
_RUN = attrgetter("rank", "stream", "ts")  # a run of the journal: lines of one rank, stream and read
MAX_LINE_BYTES = 16 * 1024  # longer lines are cut (the rest becomes the next line)
LINE_OVERHEAD = 128  # a line's JSON fields besides its text, counted in a batch's size
READ_CHUNK = 1 << 20  # bytes read per file per round


class LogBuffer:
    """Bounded FIFO of LogLines (by count and by bytes). ``offer`` never blocks."""

    def __init__(self, max_lines: int = 10000, max_bytes: int = 16 << 20):
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._q: deque[LogLine] = deque()
        self._bytes = 0
        self._cond = threading.Condition()
        # lines accepted so far, and how many of them (from the front) the shipper has delivered
        # (or given up on); ``consumers``: shippers running (none: nobody waits for delivery)
        self.offered = 0
        self.delivered = 0
        self.consumers = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._q)

    def free(self) -> tuple[int, int]:
        """(free line slots, free bytes) right now; only ever grows until the next offer."""
        with self._cond:
            return self.max_lines - len(self._q), self.max_bytes - self._bytes

    def offer(self, line: LogLine) -> bool:
        size = len(line.line)
        with self._cond:
            if len(self._q) >= self.max_lines or self._bytes + size > self.max_bytes:
                return False
            self._q.append(line)
            self._bytes += size
            self.offered += 1
            self._cond.notify()
            return True

    def offer_many(self, lines: list[LogLine]) -> int:
        n = 0
        for ln in lines:
            if not self.offer(ln):
                break
            n += 1
        return n

    def take(self, max_lines: int, max_bytes: int, timeout: float) -> list[LogLine]:
        """Up to max_lines/max_bytes lines; waits up to ``timeout`` for the first one.
        ``max_bytes`` bounds the batch as sent: each line counts its text plus LINE_OVERHEAD
        (its JSON fields)."""
        with self._cond:
            if not self._q:
                self._cond.wait(timeout)
            out: list[LogLine] = []
            size = 0
            while self._q and len(out) < max_lines:
                ln = self._q[0]
                if out and size + len(ln.line) + LINE_OVERHEAD > max_bytes:
                    break
                self._q.popleft()
                self._bytes -= len(ln.line)
                size += len(ln.line) + LINE_OVERHEAD
                out.append(ln)
            return out

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def ack(self, n: int) -> None:
        """The consumer delivered (or dropped for good) the next ``n`` lines it took."""
        with self._cond:
            self.delivered += n

    def mark(self) -> int:
        """A position: every line offered so far is before it."""
        with self._cond:
            return self.offered

    def delivered_to(self, mark: int) -> bool:
        """Whether every line before ``mark`` has left the agent (true when no shipper runs)."""
        with self._cond:
            return self.consumers == 0 or self.delivered >= mark


@dataclass
class StreamTail:
    path: str
    stream: str  # stdout | stderr
    offset: int = 0


@dataclass
class RankTail:
    rank: int
    streams: list[StreamTail]
    seq: int = 0
    dropped: int = 0  # dropped and not yet announced


@dataclass
class AttemptTail:
    """Tail state of one attempt: read offsets and seq counters, persisted in ``state_path``."""

    job_id: int
    attempt: int
    state_path: str
    ranks: dict[int, RankTail] = field(default_factory=dict)
    last_output_at: float | None = None
    lines_total: int = 0
    dropped_total: int = 0
    save_error: str | None = None  # the last save that failed on a full folder (issue 13)
    # per rank: the lines offered to the buffer and not yet shipped, in seq order (also in the
    # journal file, ``journal_path``)
    unshipped: dict[int, list[LogLine]] = field(default_factory=dict)
    _journaled: int = 0  # lines in the journal file (shipped ones too, until it is rewritten)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def journal_path(self) -> str:
        return self.state_path + ".unshipped"

    def unshipped_lines(self) -> list[LogLine]:
        with self._lock:
            return self._all_unshipped()

    def _all_unshipped(self) -> list[LogLine]:
        return [ln for q in self.unshipped.values() for ln in q]

    def journal(self, lines: list[LogLine]) -> None:
        """Keep ``lines`` (about to be offered) until they are shipped: appended to the journal
        file before the offsets that read them are saved. On a full folder they stay in memory."""
        with self._lock:
            for rank, some in groupby(lines, _RANK):
                self.unshipped.setdefault(rank, []).extend(some)
            self._write(lines, append=True)

    def shipped(self, lines: list[LogLine]) -> None:
        """The shipper delivered ``lines`` (or dropped them for good): out of the journal. A
        rank's lines leave in seq order (one FIFO buffer), so the journal records how far each
        rank was shipped (``{"shipped": {rank: seq}}``); the file is emptied once nothing is
        left and rewritten when mostly shipped lines remain."""
        upto = {ln.rank: ln.seq for ln in lines}  # (in seq order: the last of each rank is its highest)
        with self._lock:
            left = 0
            for rank, q in self.unshipped.items():
                last = upto.get(rank)
                if last is not None and q:
                    del q[:bisect_right(q, last, key=_SEQ)]
                left += len(q)
            if not self._journaled:
                return
            if not left:
                self._write([], append=False)
            elif self._journaled > 4 * left + 4096:
                self._write(self._all_unshipped(), append=False)
            else:
                self._write([], append=True, shipped=upto)

    def _write(self, lines: list[LogLine], *, append: bool, shipped: dict[int, int] | None = None) -> None:
        """Each run of lines of one rank, stream and read (consecutive seqs) as a header
        ``{"run": [rank, stream, ts, first seq, count]}`` and its texts, one a line (a text
        holds no newline: lines are split at them)."""
        parts: list[str] = []
        for (rank, stream, ts), group in groupby(lines, _RUN):
            run = list(group)
            parts.append(json.dumps({"run": [rank, stream, ts, run[0].seq, len(run)]}))
            parts.extend(ln.line for ln in run)
        if shipped:
            parts.append(json.dumps({"shipped": shipped}))
        text = "\n".join(parts) + "\n" if parts else ""
        try:
            if append:
                with open(self.journal_path, "a", encoding="utf-8") as f:
                    f.write(text)
                self._journaled += len(lines)
            else:
                tmp = self.journal_path + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, self.journal_path)
                self._journaled = len(lines)
        except OSError as e:
            self._full(e)

    def _full(self, e: OSError) -> None:
        """A write that failed on a full folder is remembered (issue 13); any other error is raised."""
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise e
        self.save_error = e.strerror or str(e)

    def save(self) -> None:
        """Persist the offsets and seqs. On a full folder (issue 13) they stay in memory (the
        next save writes them): only a restart meanwhile would read some lines again."""
        data = {
            "ranks": {
                str(r.rank): {"seq": r.seq, "dropped": r.dropped,
                              "offsets": {s.stream: s.offset for s in r.streams}}
                for r in self.ranks.values()
            },
            "lines_total": self.lines_total,
            "dropped_total": self.dropped_total,
        }
        tmp = self.state_path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.state_path)
        except OSError as e:
            self._full(e)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def load(self) -> None:
        try:
            with open(self.state_path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return
        self.lines_total = int(data.get("lines_total", 0))
        self.dropped_total = int(data.get("dropped_total", 0))
        for key, rs in data.get("ranks", {}).items():
            r = self.ranks.get(int(key))
            if r is None:
                continue
            r.seq = int(rs.get("seq", 0))
            r.dropped = int(rs.get("dropped", 0))
            for s in r.streams:
                s.offset = int(rs.get("offsets", {}).get(s.stream, 0))
        self._load_journal()

    def _load_journal(self) -> None:
        """The lines read before the restart and not shipped: those whose seq the saved state
        counts (a line journaled after the last save was never offered; it is read again) and
        past the last ``shipped`` mark of their rank."""
        try:
            with open(self.journal_path, encoding="utf-8", newline="\n") as f:
                rows = f.read().split("\n")
        except OSError:
            return
        shipped_to: dict[int, int] = {}  # rank -> the last seq shipped
        kept: list[LogLine] = []
        i, n = 0, len(rows) - 1  # (the text after the last newline: nothing, or a cut write)
        while i < n:
            try:
                head = json.loads(rows[i])
                if "shipped" in head:
                    for rank, seq in head["shipped"].items():
                        shipped_to[int(rank)] = max(int(seq), shipped_to.get(int(rank), -1))
                    i += 1
                    continue
                rank, stream, ts, first, count = head["run"]
            except (ValueError, KeyError, TypeError):  # not a header: a write cut short by the kill
                break
            texts = rows[i + 1:i + 1 + count]
            if len(texts) < count:
                break  # cut short: never offered (the offer comes after the save)
            i += 1 + count
            self._journaled += count
            r = self.ranks.get(rank)
            if r is None:
                continue
            kept.extend(LogLine(job_id=self.job_id, attempt=self.attempt, rank=rank, seq=first + k, ts=ts,
                                stream=stream, line=text) for k, text in enumerate(texts) if first + k < r.seq)
        for ln in kept:
            if ln.seq > shipped_to.get(ln.rank, -1):
                self.unshipped.setdefault(ln.rank, []).append(ln)
        # written again with only those: no shipped line, no entry cut short for later ones to follow
        self._write(self._all_unshipped(), append=False)


def _split_lines(data: bytes, final: bool) -> tuple[list[bytes], int]:
    """Complete lines of ``data`` and how many bytes they use. A trailing partial line stays
    unread unless ``final`` (the writer is gone) or it is longer than MAX_LINE_BYTES."""
    lines: list[bytes] = []
    pos = 0
    n = len(data)
    while pos < n:
        nl = data.find(b"\n", pos, pos + MAX_LINE_BYTES + 1)
        if nl >= 0:
            lines.append(data[pos:nl])
            pos = nl + 1
        elif n - pos > MAX_LINE_BYTES:
            lines.append(data[pos : pos + MAX_LINE_BYTES])
            pos += MAX_LINE_BYTES
        elif final:
            lines.append(data[pos:])
            pos = n
        else:
            break
    return lines, pos


def tail_attempt(t: AttemptTail, buf: LogBuffer, *, final: bool, now: Callable[[], float] = time.time,
                 max_file_bytes: int | None = 256 << 20) -> tuple[int, bool]:
    """One round over the attempt's files: read new lines, give them seqs, journal them, persist
    the tail state, then offer them to the buffer (lines that do not fit are dropped and counted;
    the drop marker goes out as soon as there is room). Persisting before offering means a line
    that may have been shipped never gets a second seq after an agent restart; the journal, that
    a line not yet shipped is offered again after one (``AttemptTail.unshipped``).

    ``final``: the ranks have ended, so a last line without a newline is complete too.
    Returns (lines read, whether everything in the files has been consumed)."""
    free_lines, free_bytes = buf.free()
    out: list[LogLine] = []
    read = 0
    drained = True
    changed = False
    for r in t.ranks.values():
        for s in r.streams:
            try:
                fd = os.open(s.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                size = os.fstat(fd).st_size
                if size < s.offset:  # truncated (rotated) under us: start again at 0
                    s.offset = 0
                    changed = True
                if size == s.offset:
                    continue
                data = os.pread(fd, READ_CHUNK, s.offset)
            finally:
                os.close(fd)
            at_end = s.offset + len(data) >= size
            lines, used = _split_lines(data, final and at_end)
            if s.offset + used < size:
                drained = False
            if not used:
                continue
            s.offset += used
            changed = True
            ts = now()
            for raw in lines:
                text = raw.decode("utf-8", "replace").rstrip("\r")
                read += 1
                if r.dropped and free_lines > 0:
                    marker = f"[hai] {r.dropped} lines dropped (log buffer full)"
                    out.append(LogLine(job_id=t.job_id, attempt=t.attempt, rank=r.rank, seq=r.seq,
                                       ts=ts, stream="system", line=marker))
                    r.seq += 1
                    r.dropped = 0
                    free_lines -= 1
                    free_bytes -= len(marker)
                if free_lines > 0 and free_bytes >= len(text):
                    out.append(LogLine(job_id=t.job_id, attempt=t.attempt, rank=r.rank, seq=r.seq,
                                       ts=ts, stream=s.stream, line=text))  # type: ignore[arg-type]
                    r.seq += 1
                    free_lines -= 1
                    free_bytes -= len(text)
                else:
                    r.dropped += 1
                    t.dropped_total += 1
            # keep the disk bounded under a flood: rotate a fully consumed, very large file
            if max_file_bytes and s.offset >= size and size > max_file_bytes:
                try:
                    lost = os.stat(s.path).st_size - s.offset
                    os.truncate(s.path, 0)
                    s.offset = 0
                    if lost > 0:
                        r.dropped += 1
                        t.dropped_total += 1
                except OSError:
                    pass
    # a pending drop marker with no new line to ride on
    for r in t.ranks.values():
        if r.dropped and free_lines > 0:
            marker = f"[hai] {r.dropped} lines dropped (log buffer full)"
            out.append(LogLine(job_id=t.job_id, attempt=t.attempt, rank=r.rank, seq=r.seq,
                               ts=now(), stream="system", line=marker))
            r.seq += 1
            r.dropped = 0
            free_lines -= 1
            changed = True
        if r.dropped:
            drained = False
    if read:
        t.last_output_at = now()
        t.lines_total += read
    if out:
        t.journal(out)
    if changed:
        t.save()
    if out:
        buf.offer_many(out)
    return read, drained


class LogShipper(threading.Thread):
    """Drains the buffer in batches through ``send(lines)``; a failed batch is retried (with
    backoff) — seqs make re-sends harmless — while the buffer keeps absorbing (and dropping).

    A batch stays under the server's request size limit (``limits.max_body_bytes``, 1 MiB by
    default): ``batch_bytes`` (512 KiB) counts each line's text plus its JSON fields, and a batch
    the server still refuses as too large (HTTP 413: text that JSON escapes, or a lower limit)
    is sent in halves; a single line refused so (a server limit under ~100 KiB) is dropped and
    logged by the agent.
    Before (issue 13's audit), a 1 MiB batch of text was 1.2 MiB of JSON: the server answered
    413, and the shipper retried that batch for ever, so nothing more of the node's logs
    arrived."""

    def __init__(self, buf: LogBuffer, send: Callable[[list[LogLine]], None], *,
                 stop: threading.Event, batch_lines: int = 2000, batch_bytes: int = 512 << 10,
                 backoff_max_s: float = 10.0, shipped: Callable[[list[LogLine]], None] | None = None):
        super().__init__(name="hai-agent-logs", daemon=True)
        self.buf = buf
        self.send = send
        self.on_shipped = shipped  # told of every line delivered or dropped for good (the journal)
        self.stop = stop
        self.batch_lines = batch_lines
        self.batch_bytes = batch_bytes
        self.backoff_max_s = backoff_max_s
        self.shipped = 0
        self.refused = 0  # single lines the server refused as too large (dropped)
        self.idle = threading.Event()

    def run(self) -> None:
        with self.buf._cond:
            self.buf.consumers += 1
        try:
            self._run()
        finally:
            with self.buf._cond:
                self.buf.consumers -= 1

    def _delivered(self, lines: list[LogLine]) -> None:
        if self.on_shipped is not None:
            try:
                self.on_shipped(lines)
            except Exception:  # the journal is a safety net: shipping goes on without it
                log.exception("recording shipped log lines")
        self.buf.ack(len(lines))

    def _run(self) -> None:
        pending: list[LogLine] = []
        n = 0  # how many of ``pending`` the next send carries
        backoff = 0.2
        while True:
            if not pending:
                if self.stop.is_set() and len(self.buf) == 0:
                    return
                pending = self.buf.take(self.batch_lines, self.batch_bytes, timeout=0.2)
                if not pending:
                    self.idle.set()
                    continue
                self.idle.clear()
                n = len(pending)
            try:
                self.send(pending[:n])
            except Exception as e:  # server unreachable or refusing: keep the batch, back off
                if getattr(e, "status", None) == 413:  # too large for the server: halve it
                    if n > 1:
                        n //= 2
                        continue
                    log.warning("the server refused a log line of job %s as too large; dropped", pending[0].job_id)
                    self.refused += 1
                    self._delivered(pending[:1])
                    pending = pending[1:]
                    n = len(pending)
                    continue
                log.debug("log shipping failed (%s); retrying in %.1fs", e, backoff)
                if self.stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self.backoff_max_s)
                continue
            self.shipped += n
            self._delivered(pending[:n])
            pending = pending[n:]
            n = min(len(pending), max(n, 1))
            backoff = 0.2
