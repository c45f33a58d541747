"""One write a response or two: uvicorn's httptools protocol against ``hai.api.http_protocol``'s
(issue 12), alternated in one run.

    python benchmarks/response_writes.py [--requests 20000] [--rounds 3]

A uvicorn server (uvloop, one process) answers each request with a small JSON document, as a
submission's answer (201, ~300 bytes), from a bare ASGI app; one client on a raw keep-alive socket
sends the next request when the last answer is whole. Reported per request: the server's CPU
(user + system from /proc, the kernel's work for each write included), the client's CPU, the wall
time and the client's reads. Prints one JSON object (``--out FILE`` writes it too).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "backend"))
sys.path.insert(0, str(ROOT))

from api_load import cpu_s, wait_for  # noqa: E402

BODY = json.dumps({"id": 123456, "state": "queued", "priority": "normal", "user": "bench", "gpus": 1,
                   "pending_reason": "waiting for the scheduler", "queue_position": None,
                   "command": "sleep 1", "submitted_at": "2026-12-07T21:00:00.000000Z"}).encode()
PROTOCOLS = {"uvicorn": "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol",
             "hai": "hai.api.http_protocol:CoalescingHttpToolsProtocol"}


async def app(scope, receive, send):  # noqa: ANN001, ANN201
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]})
    await send({"type": "http.response.body", "body": BODY})


def serve(protocol: str, sock: socket.socket) -> None:
    import uvicorn

    config = uvicorn.Config(app, http=protocol, loop="uvloop", log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


def measure(protocol: str, n: int) -> dict:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the server
        try:
            serve(protocol, sock)
        finally:
            os._exit(0)
    sock.close()
    try:
        c = wait_for(lambda: socket.create_connection(("127.0.0.1", port), timeout=10), 30, "the server", interval=0.05)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = f"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 2\r\n\r\n{{}}".encode()

        def one() -> int:
            c.sendall(request)
            got, reads = b"", 0
            while not got.endswith(BODY):  # the answer whole: its head and the whole body
                got += c.recv(65536)
                reads += 1
            return reads

        for _ in range(500):  # warm-up
            one()
        s0, c0, t0 = cpu_s([pid]), time.process_time(), time.perf_counter()
        reads = sum(one() for _ in range(n))
        wall, client, server = time.perf_counter() - t0, time.process_time() - c0, cpu_s([pid]) - s0
        c.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return {"server_cpu_us": round(server * 1e6 / n, 1), "client_cpu_us": round(client * 1e6 / n, 1),
            "wall_us": round(wall * 1e6 / n, 1), "reads_per_response": round(reads / n, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3, help="each protocol this many times, alternated")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {k: [] for k in PROTOCOLS}
    for _ in range(args.rounds):
        for name, protocol in PROTOCOLS.items():
            runs[name].append(r := measure(protocol, args.requests))
            print(f"  {name:8s} {r}", file=sys.stderr, flush=True)
    out = {"requests": args.requests, "rounds": args.rounds, "body_bytes": len(BODY), "runs": runs,
           "median": {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
