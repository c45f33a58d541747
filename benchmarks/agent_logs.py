"""The agent's CPU a log line: read from a rank's file, given its seq, kept until shipped
(journaled), offered to the buffer, taken in batches and marked shipped (no network).

    python benchmarks/agent_logs.py [--lines 200000] [--width 100] [--backend <other checkout>/backend]

Writes ``--lines`` lines of ``--width`` characters to a rank's stdout file in a temporary folder,
then runs the tailer (``hai.agent.logs.tail_attempt``) round after round while a consumer takes
batches of 2,000 lines from the buffer and reports them shipped (``AttemptTail.shipped``, where the
checkout has it), as the log shipper does after a delivered batch. Prints one JSON object: CPU
microseconds a line (``time.process_time``), lines a second, the journal's size at the end. With
``--backend`` the same against another checkout's agent (e.g. one before the journal).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--width", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="repeat; the median is reported")
    ap.add_argument("--backend", type=Path, default=Path(__file__).resolve().parents[1] / "backend")
    args = ap.parse_args()
    sys.path.insert(0, str(args.backend))
    from hai.agent.logs import AttemptTail, LogBuffer, RankTail, StreamTail, tail_attempt

    results = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="hai-agent-logs-") as d:
            out = Path(d) / "0.stdout"
            line = "x" * (args.width - 1)
            out.write_text("".join(f"{i:09d} {line[10:]}\n" for i in range(args.lines)))
            t = AttemptTail(job_id=1, attempt=1, state_path=str(Path(d) / "logstate.json"))
            t.ranks[0] = RankTail(rank=0, streams=[StreamTail(path=str(out), stream="stdout")])
            buf = LogBuffer(max_lines=100_000, max_bytes=64 << 20)  # (room for a round: nothing dropped)
            shipped = getattr(t, "shipped", None)
            got = 0
            drained = False
            c0 = time.process_time()
            while not drained or len(buf):
                drained = tail_attempt(t, buf, final=True)[1]
                while True:
                    batch = buf.take(2000, 512 << 10, 0)
                    if not batch:
                        break
                    if shipped is not None:
                        shipped(batch)
                    buf.ack(len(batch))
                    got += len(batch)
            cpu = time.process_time() - c0
            if got != args.lines or t.dropped_total:
                raise SystemExit(f"{got} lines delivered of {args.lines}, {t.dropped_total} dropped")
            journal = Path(t.state_path + ".unshipped")
            results.append({"cpu_us_per_line": round(cpu * 1e6 / got, 2), "lines_per_s": round(got / cpu),
                            "journal_bytes_at_end": journal.stat().st_size if journal.exists() else None})
    results.sort(key=lambda r: r["cpu_us_per_line"])
    print(json.dumps({"backend": str(args.backend), "lines": args.lines, "width": args.width,
                      "rounds": results, "median": results[len(results) // 2]}))


if __name__ == "__main__":
    main()
