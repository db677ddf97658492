"""Strangers flooding a token job's store: what a member's request costs meanwhile.

Our ``TCPStoreServer`` with a job token runs in a process of its own (as in the agent
that hosts it). ``--strangers`` connections without the token (one attacker process,
non-blocking sockets) send VALIDATE and then PINGs pipelined as fast as the server takes
them, never reading an answer, and reconnect whenever it drops them. Meanwhile a member
(a client that proved the token) sends one ``check`` every ``--every`` s and times it.
Reported per phase (quiet first, then flooded): median, p99 and max latency of the
member's requests, and how many connections the strangers opened. ``--no-budget`` runs
the server without the strangers' budget and cap (``admission.Admission.budgeted``
false), as before they existed, for comparison.

    python bench/store_flood.py --strangers 32 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from elastic.core.tcpstore import TCPStoreClient

HOST = "127.0.0.1"
TOKEN = b"bench-flood-token"
SERVER = """\
import sys, time
from elastic.core.tcpstore import TCPStoreServer, admission
if sys.argv[2] == "no-budget":  # strangers untracked: no budget, no cap of their own
    admission.Admission.budgeted = property(lambda self: False)
server = TCPStoreServer(sys.argv[1], 0, token=b"bench-flood-token")
print(server.port, flush=True)
time.sleep(3600)
"""
FLOODER = """\
import selectors, socket, sys, time
from elastic.core.tcpstore import wire
host, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
validate = wire.request(wire.Query.VALIDATE, wire.U32.pack(wire.VALIDATION_MAGIC))
burst = wire.request(wire.Query.PING, wire.U32.pack(7)) * 4096
sel = selectors.DefaultSelector()
opened = 0
def open_one():
    global opened
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((host, port))
    sel.register(s, selectors.EVENT_WRITE, bytearray(validate))
    opened += 1
for _ in range(n):
    open_one()
end = time.monotonic() + seconds
while time.monotonic() < end:
    for key, mask in sel.select(0.1):
        s, pending = key.fileobj, key.data
        try:
            if not pending:  # never reads an answer: only sends, as fast as taken
                pending += burst
            del pending[: s.send(pending)]
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            sel.unregister(s)
            s.close()
            open_one()
print(opened, flush=True)
"""


def measure(port: int, seconds: float, every: float) -> list[float]:
    """Seconds each of the member's requests took, one every ``every`` s."""
    client = TCPStoreClient(HOST, port, timeout=30.0, token=TOKEN)
    client.set("member-key", "1")
    times = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            started = time.perf_counter()
            client.check(["member-key"])
            times.append(time.perf_counter() - started)
            time.sleep(every)
    finally:
        client.close()
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "requests": len(times),
        "median_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strangers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--every", type=float, default=0.01, help="s between member requests")
    parser.add_argument("--no-budget", action="store_true")
    args = parser.parse_args()
    env = dict(os.environ)
    budget = "no-budget" if args.no_budget else "budget"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, HOST, budget], stdout=subprocess.PIPE, text=True, env=env
    )
    assert server.stdout is not None
    port = int(server.stdout.readline())
    try:
        quiet = summary(measure(port, min(5.0, args.seconds), args.every))
        flooder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                FLOODER,
                HOST,
                str(port),
                str(args.strangers),
                str(args.seconds),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        time.sleep(1.0)  # the flood under way
        flooded = summary(measure(port, args.seconds - 2.0, args.every))
        out, _ = flooder.communicate(timeout=args.seconds + 30)
        opened = int(out.strip() or 0)
    finally:
        server.kill()
        server.wait()
    load = os.getloadavg()
    result = {
        "strangers": args.strangers,
        "budget": not args.no_budget,
        "quiet": quiet,
        "flooded": flooded,
        "stranger_connections_opened": opened,
        "loadavg": [round(x, 2) for x in load],
    }
    print(f"{'phase':<10}{'requests':>10}{'median ms':>12}{'p99 ms':>10}{'max ms':>10}")
    for phase in ("quiet", "flooded"):
        row = result[phase]
        assert isinstance(row, dict)
        print(
            f"{phase:<10}{row['requests']:>10}{row['median_ms']:>12}{row['p99_ms']:>10}"
            f"{row['max_ms']:>10}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
