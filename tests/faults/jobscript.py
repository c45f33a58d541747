"""The fault harness's job: runs for ``--seconds`` of work, then exits with ``--exit-code``.

It appends marks (one JSON line each, O_APPEND: atomic) to ``--marks``: ``start`` (pid, node,
attempt, rank, the checkpoint it resumes from), ``tick`` every 0.2 s while it runs, ``ckpt`` for
each checkpoint it reported, ``stop`` when it ends. With ``--checkpoint-every S`` it saves its
progress through the SDK every S seconds of work and on a suspend request (then says
suspend_ready and waits to be stopped); a resumed attempt continues from the checkpoint's
progress. A checkpoint that cannot be written (disk full) is caught as the SDK's ``StorageFull``
(``with sdk.storage(path)``: the platform is told); the job goes on without it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from hai import sdk

ap = argparse.ArgumentParser()
ap.add_argument("--seconds", type=float, default=1.0)
ap.add_argument("--exit-code", type=int, default=0)
ap.add_argument("--checkpoint-every", type=float, default=0.0)
ap.add_argument("--marks", required=True)
ap.add_argument("--chatty", action="store_true", help="print a line to stdout on every tick")
args = ap.parse_args()

JOB = int(os.environ.get("HAI_JOB_ID", "0"))
ATTEMPT = int(os.environ.get("HAI_ATTEMPT", "0"))
RANK = int(os.environ.get("RANK", "0"))
NODE = os.environ.get("HAI_NODE", "?")


def mark(ev: str, **extra) -> None:
    line = json.dumps({"ev": ev, "job": JOB, "attempt": ATTEMPT, "rank": RANK, "pid": os.getpid(), "node": NODE,
                       "t": time.time(), **extra}) + "\n"
    fd = os.open(args.marks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def on_term(signum, frame):  # noqa: ANN001
    mark("stop", why=f"signal {signum}", done=done)
    sys.exit(128 + signum)


done = 0.0
resume = sdk.resume_path()
if resume:
    with open(resume) as f:
        done = float(json.load(f)["done"])
signal.signal(signal.SIGTERM, on_term)
mark("start", resume_from=resume, done=done)


def checkpoint() -> None:
    ckdir = sdk.checkpoint_dir()
    if not ckdir or RANK != 0:
        return
    path = os.path.join(ckdir, f"ckpt-{ATTEMPT:03d}-{done:08.2f}.json")
    try:
        with sdk.storage(path), open(path, "w") as f:
            json.dump({"done": done}, f)
            f.flush()
            os.fsync(f.fileno())
    except sdk.StorageFull as e:  # the disk is full: the platform knows; go on without this one
        print(f"checkpoint skipped: {e}", file=sys.stderr, flush=True)
        mark("ckpt_failed", error=str(e))
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    sdk.report_checkpoint(path, step=int(done * 10))
    mark("ckpt", path=path, done=done)


last_ckpt = done
last_tick = 0.0
while done < args.seconds:
    time.sleep(0.05)
    done += 0.05
    now = time.time()
    if now - last_tick >= 0.2:
        mark("tick", done=done)
        last_tick = now
        if args.chatty:  # plain print: a full log folder must not break it (rankwrap keeps it flowing)
            print(f"tick {done:.2f} " + "x" * 200)
    if args.checkpoint_every and done - last_ckpt >= args.checkpoint_every:
        checkpoint()
        last_ckpt = done
    if args.checkpoint_every and sdk.should_suspend(sync=False):
        checkpoint()
        sdk.suspend_ready(barrier=False)
        mark("suspend_ready", done=done)
        while True:  # the agent stops us
            time.sleep(0.2)
            mark("tick", done=done)

mark("stop", why="done", done=done)
sys.exit(args.exit_code)
