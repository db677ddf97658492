"""What the job token costs: a store connection, and rank 0's heartbeat read.

Side by side in one process, interleaved (token first on odd repetitions), on our own
store server on loopback:

- ``connect``: a ``TCPStoreClient`` connecting (VALIDATE, PING, the AUTH handshake: one
  round trip without a token, two with one) and closing;
- ``tick``: rank 0's tick read, one ``multi_get`` of ``events`` and N heartbeats through
  the round's ``SignedStore`` view (with a token every value's signature is checked).

Prints a table (median, min-max, ratio token / none) and JSON. Usage::

    python bench/auth.py [--repeat 5] [--connects 300] [--nodes 256] [--ticks 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.signing import SignedStore
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer
from elastic.core.tcpstore.view import Connection, PrefixStore

TOKEN = b"bench-token"


def per_call(fn: Callable[[], object], n: int) -> float:
    """Median seconds of ``fn`` over ``n`` calls."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def connect(token: bytes | None, n: int) -> float:
    with TCPStoreServer("127.0.0.1", 0, token=token) as server:
        return per_call(lambda: TCPStoreClient("127.0.0.1", server.port, token=token).close(), n)


def tick(token: bytes | None, nodes: int, n: int) -> float:
    with TCPStoreServer("127.0.0.1", 0, token=token) as server:
        conn = Connection("127.0.0.1", server.port, 10.0, token=token)
        store = SignedStore(PrefixStore(conn, "elastic/bench/"), token, "bench").sub("rdzv/")
        members = [f"host{i}:1:{i:012x}" for i in range(nodes)]
        for i, node in enumerate(members):
            store.heartbeat(R.hb_key(node), f"{i} {time.time():.3f}")
        store.add(R.EVENTS, 1)
        keys = [R.EVENTS] + [R.hb_key(m) for m in members]
        try:
            return per_call(lambda: store.read(keys), n)
        finally:
            conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--connects", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--ticks", type=int, default=200)
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {
        "connect": {"none": [], "token": []},
        "tick": {"none": [], "token": []},
    }
    for rep in range(args.repeat):
        order = [None, TOKEN] if rep % 2 == 0 else [TOKEN, None]
        for token in order:
            name = "none" if token is None else "token"
            results["connect"][name].append(connect(token, args.connects))
            results["tick"][name].append(tick(token, args.nodes, args.ticks))
    print(f"{'scenario':<10} {'no token (ms)':>22} {'token (ms)':>22} {'ratio':>6}")
    for scenario, runs in results.items():
        cells = []
        for name in ("none", "token"):
            ms = [v * 1e3 for v in runs[name]]
            cells.append(f"{statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})")
        ratio = statistics.median(runs["token"]) / statistics.median(runs["none"])
        print(f"{scenario:<10} {cells[0]:>22} {cells[1]:>22} {ratio:>6.2f}")
    print(json.dumps({"nodes": args.nodes, "results": results}))


if __name__ == "__main__":
    main()
