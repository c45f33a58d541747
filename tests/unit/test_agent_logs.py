"""Log capture: bounded buffer, a flood never blocks the job, drop marker with count, seqs that
survive a restart."""

from __future__ import annotations

import re
import sys
import threading
import time

from hai.agent.gpu import FakeGpus
from hai.agent.logs import AttemptTail, LogBuffer, LogShipper, RankTail, StreamTail, tail_attempt
from hai.agent.node import NodeAgent
from hai.agent.testing import assignment, wait_for
from hai.protocol import LogLine

PY = sys.executable
DROP = re.compile(r"^\[hai\] (\d+) lines dropped \(log buffer full\)$")


def _line(i: int, text: str = "x") -> LogLine:
    return LogLine(job_id=1, attempt=0, rank=0, seq=i, ts=0.0, line=text)


def test_the_buffer_is_bounded_by_lines_and_bytes_and_never_blocks():
    buf = LogBuffer(max_lines=3, max_bytes=10)
    assert [buf.offer(_line(i)) for i in range(4)] == [True, True, True, False]
    assert [ln.seq for ln in buf.take(10, 1 << 20, timeout=0)] == [0, 1, 2]
    assert buf.offer(_line(0, "0123456789")) and not buf.offer(_line(1, "y"))
    assert buf.take(10, 1 << 20, timeout=0)[0].line == "0123456789"
    t0 = time.monotonic()
    assert buf.take(10, 100, timeout=0.05) == []
    assert time.monotonic() - t0 < 1


def _tail(tmp_path, streams=("stdout",)):
    t = AttemptTail(job_id=1, attempt=0, state_path=str(tmp_path / "logstate.json"))
    t.ranks[0] = RankTail(rank=0, streams=[StreamTail(path=str(tmp_path / f"0.{s}"), stream=s) for s in streams])
    return t


def test_partial_lines_wait_for_their_newline_unless_the_rank_ended(tmp_path):
    buf = LogBuffer()
    t = _tail(tmp_path)
    f = tmp_path / "0.stdout"
    f.write_bytes(b"one\ntw")
    assert tail_attempt(t, buf, final=False) == (1, False)
    with open(f, "ab") as fh:
        fh.write(b"o\nthree")
    tail_attempt(t, buf, final=False)
    assert tail_attempt(t, buf, final=True)[1] is True
    lines = buf.take(100, 1 << 20, 0)
    assert [(ln.seq, ln.line) for ln in lines] == [(0, "one"), (1, "two"), (2, "three")]


def test_drops_are_counted_and_announced_in_the_same_sequence(tmp_path):
    buf = LogBuffer(max_lines=5)
    t = _tail(tmp_path)
    (tmp_path / "0.stdout").write_text("".join(f"line {i}\n" for i in range(12)))
    tail_attempt(t, buf, final=False)
    first = buf.take(100, 1 << 20, 0)
    assert [ln.line for ln in first] == [f"line {i}" for i in range(5)]
    with open(tmp_path / "0.stdout", "a") as fh:
        fh.write("after\n")
    tail_attempt(t, buf, final=False)
    second = buf.take(100, 1 << 20, 0)
    assert [(ln.seq, ln.stream, ln.line) for ln in second] == [
        (5, "system", "[hai] 7 lines dropped (log buffer full)"), (6, "stdout", "after")]
    assert t.dropped_total == 7


def _read_then_more(tmp_path, then=None) -> LogBuffer:  # noqa: ANN001
    """A round over stdout "a", "b" and stderr "E"; ``then(t, buf)``; then "c" on stdout."""
    buf = LogBuffer()
    t = _tail(tmp_path, streams=("stdout", "stderr"))
    (tmp_path / "0.stdout").write_text("a\nb\n")
    (tmp_path / "0.stderr").write_text("E\n")
    tail_attempt(t, buf, final=False)
    if then is not None:
        then(t, buf)
    with open(tmp_path / "0.stdout", "a") as fh:
        fh.write("c\n")
    return buf


def test_the_tail_state_survives_a_restart_without_reusing_a_seq(tmp_path):
    buf = _read_then_more(tmp_path)
    t2 = _tail(tmp_path, streams=("stdout", "stderr"))  # a new agent process
    t2.load()
    tail_attempt(t2, buf, final=False)
    lines = buf.take(100, 1 << 20, 0)
    assert [(ln.seq, ln.stream, ln.line) for ln in lines] == [
        (0, "stdout", "a"), (1, "stdout", "b"), (2, "stderr", "E"), (3, "stdout", "c")]


def test_lines_not_shipped_before_a_restart_are_offered_again_under_their_seqs(tmp_path):
    read: list[LogLine] = []

    def ship_two(t, buf) -> None:  # noqa: ANN001
        read.extend(buf.take(100, 1 << 20, 0))
        t.shipped(read[:2])  # a and b delivered, E not yet

    buf = _read_then_more(tmp_path, ship_two)
    t2 = _tail(tmp_path, streams=("stdout", "stderr"))  # the agent killed and started again
    t2.load()
    assert [(ln.seq, ln.stream, ln.line) for ln in t2.unshipped_lines()] == [(2, "stderr", "E")]
    tail_attempt(t2, buf, final=False)
    assert [(ln.seq, ln.line) for ln in buf.take(100, 1 << 20, 0)] == [(3, "c")]
    t2.shipped([read[2]])
    t3 = _tail(tmp_path, streams=("stdout", "stderr"))
    t3.load()
    assert [(ln.rank, ln.seq) for ln in t3.unshipped_lines()] == [(0, 3)]  # c is still on its way; E no longer


def test_a_line_journaled_after_the_last_saved_offsets_is_read_again_not_offered_twice(tmp_path):
    """Killed between journaling a round's lines and saving its offsets: the lines were never
    offered (the offer comes after the save), so they are read again from the file, with the
    same seqs, and not offered from the journal as well."""
    buf = LogBuffer()
    t = _tail(tmp_path)
    (tmp_path / "0.stdout").write_text("x\ny\n")
    tail_attempt(t, buf, final=False)
    (tmp_path / "logstate.json").write_text("{}")  # as if the save had not happened
    t2 = _tail(tmp_path)
    t2.load()
    assert t2.unshipped_lines() == []
    buf2 = LogBuffer()
    tail_attempt(t2, buf2, final=False)
    assert [(ln.seq, ln.line) for ln in buf2.take(100, 1 << 20, 0)] == [(0, "x"), (1, "y")]


def test_a_journal_write_cut_short_by_the_kill_is_read_up_to_its_last_whole_run(tmp_path):
    """Killed while journaling a round (so before its offsets were saved): the whole runs before
    it are offered again, the cut one is read again from the files."""
    buf = LogBuffer()
    t = _tail(tmp_path)
    out = tmp_path / "0.stdout"
    out.write_text("a\nb\n")
    tail_attempt(t, buf, final=False)
    state_after_first = (tmp_path / "logstate.json").read_bytes()
    with open(out, "a") as fh:
        fh.write("c\nd\n")
    tail_attempt(t, buf, final=False)
    journal = tmp_path / "logstate.json.unshipped"
    journal.write_bytes(journal.read_bytes()[:-3])  # the second round's write, cut
    (tmp_path / "logstate.json").write_bytes(state_after_first)  # and its save never happened
    t2 = _tail(tmp_path)
    t2.load()
    assert [(ln.seq, ln.line) for ln in t2.unshipped_lines()] == [(0, "a"), (1, "b")]
    buf2 = LogBuffer()
    tail_attempt(t2, buf2, final=False)
    assert [(ln.seq, ln.line) for ln in buf2.take(100, 1 << 20, 0)] == [(2, "c"), (3, "d")]
    t3 = _tail(tmp_path)  # killed again: the journal goes on past the cut
    t3.load()
    assert [(ln.seq, ln.line) for ln in t3.unshipped_lines()] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]


def test_the_journal_keeps_only_what_is_not_shipped(tmp_path):
    buf = LogBuffer(max_lines=20000)
    t = _tail(tmp_path)
    journal = tmp_path / "logstate.json.unshipped"
    (tmp_path / "0.stdout").write_text("".join(f"{i}\n" for i in range(10000)))
    tail_attempt(t, buf, final=False)
    lines = buf.take(10000, 64 << 20, 0)
    full = journal.stat().st_size
    t.shipped(lines[:2000])  # a batch: its mark appended
    assert journal.stat().st_size > full
    t.shipped(lines[2000:9000])  # mostly shipped: rewritten with the 1,000 left
    assert journal.stat().st_size < full / 5
    again = _tail(tmp_path)
    again.load()
    assert [ln.seq for ln in again.unshipped_lines()] == list(range(9000, 10000))
    t.shipped(lines[9000:])
    assert journal.read_text() == "" and t.unshipped_lines() == []


def test_very_long_lines_are_cut_not_buffered_forever(tmp_path):
    buf = LogBuffer()
    t = _tail(tmp_path)
    (tmp_path / "0.stdout").write_bytes(b"x" * 40000)
    tail_attempt(t, buf, final=False)
    lines = buf.take(100, 1 << 20, 0)
    assert [len(ln.line) for ln in lines] == [16384, 16384]


def test_a_log_flood_never_blocks_the_job_and_losses_are_visible(tmp_path):
    """The server is stuck (the shipper blocks); a job printing 200k lines still runs at full
    speed; once the server is back, the lines that fitted arrive in order, the rest is counted."""
    n_lines = 200_000
    buf = LogBuffer(max_lines=1000)
    node = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(1, node="n1"), log_buffer=buf,
                     log_drain_s=0.5)  # the finish waits for the stuck shipper only briefly
    received: list[LogLine] = []
    gate = threading.Event()

    def send(lines):
        gate.wait()
        received.extend(lines)

    stop = threading.Event()
    shipper = LogShipper(buf, send, stop=stop)
    shipper.start()
    tail_stop = threading.Event()

    def tail_loop():
        while not tail_stop.is_set():
            if not node.tail_logs():
                tail_stop.wait(0.05)

    tailer = threading.Thread(target=tail_loop, daemon=True)
    tailer.start()
    code = (f"import sys, time\nt = time.perf_counter()\nw = sys.stdout.write\n"
            f"for i in range({n_lines}): w(f'flood line {{i}}\\n')\n"
            f"sys.stderr.write(f'took {{time.perf_counter() - t:.3f}}\\n')\n")
    try:
        node.apply([assignment(1, [PY, "-c", code], env={"PYTHONUNBUFFERED": "0"})])
        att = node.attempts[(1, 0)]
        wait_for(lambda: node.attempts[(1, 0)].finished, timeout=60, step=node.tick, what="the flood to end")
        assert att.ranks[0].exit_code == 0
        assert len(received) == 0  # nothing could be shipped meanwhile: the job did not wait for it
        gate.set()
        wait_for(lambda: att.drained, timeout=60, what="the tail to drain")
        wait_for(lambda: len(buf) == 0 and shipper.idle.is_set(), timeout=30, what="shipping")
    finally:
        gate.set()
        tail_stop.set()
        stop.set()
        tailer.join(5)
        shipper.join(5)
    out = [ln for ln in received if ln.stream == "stdout"]
    err = [ln for ln in received if ln.stream == "stderr"]  # the job's "took ..." line, if it fitted
    dropped = sum(int(DROP.match(ln.line).group(1)) for ln in received if ln.stream == "system")
    assert dropped > 0 and len(out) + len(err) + dropped == n_lines + 1
    seqs = [ln.seq for ln in received]
    assert sorted(seqs) == list(range(len(seqs)))  # gapless, unique: the markers take seqs too
    nums = [int(ln.line.split()[-1]) for ln in out]
    assert nums == sorted(nums)  # what got through is in order


def test_batches_fit_the_servers_body_limit_and_a_refused_batch_is_split_not_retried_for_ever():
    """Issue 13's audit: a batch of 1 MiB of text was 1.2 MiB of JSON, over the server's 1 MiB
    body limit: 413, retried for ever, and nothing more of the node's logs arrived. The send
    here refuses, as the server does, any batch whose JSON is over 1 MiB (with the real error
    the agent's client raises); lines full of control characters (escaped six-fold in JSON)
    force the split too."""
    from hai.agent.client import Rejected
    from hai.protocol import LogBatch

    limit = 1 << 20
    buf = LogBuffer(max_lines=100_000, max_bytes=64 << 20)
    sent: list[list[LogLine]] = []
    refused = []

    def send(lines):
        size = len(LogBatch(node="n1", lines=lines).model_dump_json())
        if size > limit:
            refused.append(size)
            raise Rejected(413, f"the request body is {size} bytes; at most {limit} are accepted")
        sent.append(lines)

    plain = [LogLine(job_id=1, attempt=1, rank=0, seq=i, ts=1.0, stream="stdout", line="x" * 500) for i in range(6000)]
    escaped = [LogLine(job_id=1, attempt=1, rank=0, seq=6000 + i, ts=1.0, stream="stdout", line="\x01" * 16000)
               for i in range(40)]
    assert buf.offer_many(plain + escaped) == len(plain) + len(escaped)
    stop = threading.Event()
    shipper = LogShipper(buf, send, stop=stop, backoff_max_s=0.2)
    shipper.start()
    try:
        wait_for(lambda: shipper.shipped == len(plain) + len(escaped), timeout=60, what="every line shipped")
    finally:
        stop.set()
        shipper.join(5)
    got = [ln.seq for batch in sent for ln in batch]
    assert got == list(range(len(plain) + len(escaped)))  # all of them, in order, once each
    assert all(len(LogBatch(node="n1", lines=b).model_dump_json()) <= limit for b in sent)
    assert refused and shipper.refused == 0  # the escaped lines needed a split; no line was lost


def _status(node, key=(1, 0)):
    return next(st for st in node.statuses() if (st.job_id, st.attempt) == key)


def test_an_attempt_is_reported_finished_only_after_its_last_lines_left_the_agent(tmp_path):
    """Logs and statuses travel separately; the server ends a job (and a log follower stops)
    on the finished status, so the status waits until the shipper delivered the last line."""
    buf = LogBuffer()
    node = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(1, node="n1"), log_buffer=buf,
                     log_drain_s=300)
    received: list[str] = []
    finished_when_sent: list[bool] = []
    gate = threading.Event()

    def send(lines):
        gate.wait()
        finished_when_sent.append(_status(node).finished)
        received.extend(ln.line for ln in lines)

    stop = threading.Event()
    shipper = LogShipper(buf, send, stop=stop)
    shipper.start()
    try:
        node.apply([assignment(1, [PY, "-c", "print('first'); print('last words', end='')"])])
        att = node.attempts[(1, 0)]
        wait_for(lambda: att.ended_at is not None, timeout=30, step=node.tick, what="the rank to end")
        node.tick()
        st = _status(node)
        assert [r.exit_code for r in st.ranks] == [0] and not st.finished  # its lines are still here
        gate.set()
        wait_for(lambda: _status(node).finished, timeout=30, step=node.tick, what="the finished status")
        assert received == ["first", "last words"]  # the unterminated last line too
        assert finished_when_sent == [False]
        assert _status(node).finished_at == att.ended_at  # when the ranks ended, not when the logs left
    finally:
        gate.set()
        stop.set()
        shipper.join(5)


def test_a_server_that_takes_no_logs_delays_the_finish_by_at_most_log_drain_s(tmp_path):
    now = [1_000_000.0]
    buf = LogBuffer()
    node = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(1, node="n1"), log_buffer=buf,
                     log_drain_s=30, clock=lambda: now[0])

    def send(lines):
        raise ConnectionError("server unreachable")

    stop = threading.Event()
    shipper = LogShipper(buf, send, stop=stop, backoff_max_s=0.2)
    shipper.start()
    try:
        node.apply([assignment(1, [PY, "-c", "print('unheard')"])])
        att = node.attempts[(1, 0)]
        wait_for(lambda: att.ended_at is not None, timeout=30, step=node.tick, what="the rank to end")
        now[0] += 29
        node.tick()
        assert not _status(node).finished
        now[0] += 1
        node.tick()
        assert _status(node).finished and shipper.shipped == 0
    finally:
        stop.set()
        shipper.join(5)


def test_without_a_shipper_an_ended_attempt_finishes_at_once(tmp_path):
    node = NodeAgent(node="n1", state_dir=tmp_path / "state", gpus=FakeGpus(1, node="n1"), log_drain_s=300)
    node.apply([assignment(1, [PY, "-c", "print('x')"])])
    att = node.attempts[(1, 0)]
    wait_for(lambda: att.ended_at is not None, timeout=30, step=node.tick, what="the rank to end")
    assert att.finished  # the same tick: nothing to wait for
