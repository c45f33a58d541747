"""What the rank wrapper's output copy costs a job that floods its output (issue 13).

Since a full log folder must drop a rank's output and not the rank, the wrapper
(``hai/agent/rankwrap.py``) takes the command's stdout/stderr through pipes and copies them into
the rank's log file. This times a job writing ``--mb`` MB of 100-byte lines to stdout, straight
into a file (as ranks did before) and through the wrapper, alternately, ``--runs`` times each.

    python benchmarks/rank_output.py [--mb 200] [--runs 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANKWRAP = Path(__file__).resolve().parents[1] / "backend" / "hai" / "agent" / "rankwrap.py"


def job(mb: int) -> list[str]:
    code = (f"import sys\nb = b'x' * 99 + b'\\n'\nw = sys.stdout.buffer.write\n"
            f"for _ in range({mb} * 10_000): w(b)\n")
    return [sys.executable, "-c", code]


def run(argv: list[str], out: Path) -> float:
    out.unlink(missing_ok=True)
    with open(out, "ab") as f:
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=f, stdin=subprocess.DEVNULL, check=True)
        took = time.perf_counter() - t0
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out, exit_file = Path(d) / "rank.stdout", Path(d) / "rank.exit"
        direct, wrapped = [], []
        for _ in range(a.runs):
            direct.append(run(job(a.mb), out))
            assert out.stat().st_size == a.mb * 1_000_000
            wrapped.append(run([sys.executable, "-I", "-S", str(RANKWRAP), "--exit-file", str(exit_file), "--",
                                *job(a.mb)], out))
            assert out.stat().st_size == a.mb * 1_000_000
    res = {"mb": a.mb, "runs": a.runs, "direct_s": direct, "wrapped_s": wrapped,
           "direct_median_s": statistics.median(direct), "wrapped_median_s": statistics.median(wrapped),
           "load_average": os.getloadavg()}
    res["wrapped_over_direct"] = res["wrapped_median_s"] / res["direct_median_s"]
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{a.mb} MB of 100-byte lines, median of {a.runs}: straight to the file {res['direct_median_s']:.2f} s, "
              f"through rankwrap {res['wrapped_median_s']:.2f} s ({res['wrapped_over_direct']:.2f}x); "
              f"load {res['load_average'][0]:.2f}")


if __name__ == "__main__":
    main()
