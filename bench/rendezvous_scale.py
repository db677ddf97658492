"""Rendezvous at scale: N handlers as threads of one process against one loopback store.

    python bench/rendezvous_scale.py --backend c10d --nodes 64 --repeat 3

Runs N of our c10d handlers and N of torch's own c10d handler
(torch.distributed.elastic.rendezvous.dynamic_rendezvous) in the same run, each against
its own loopback TCPStore, and prints JSON with both times and their ratio. Every store
client is connected *before* the clock starts (torch's TCPStore client does a reverse DNS
query per connection, and a lost query stalls 5 s here); connection time is reported
separately, with RES_OPTIONS="timeout:1 attempts:1" unless the caller set RES_OPTIONS.
The timed region is from releasing all N threads into next_rendezvous() until the last
returns. torch's run is capped by --torch-timeout and reported as "did not finish".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # before any resolver use


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def raise_fd_limit(nodes: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * nodes + 256))  # ~2 connections per handler, both ends
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def run_threads(calls: list[Callable[[], Any]], timeout: float) -> tuple[float | None, list[Any]]:
    """Start all calls together; seconds until the last returns, or None past ``timeout``."""
    results: list[Any] = [None] * len(calls)
    go = threading.Event()

    def body(i: int) -> None:
        go.wait()
        try:
            results[i] = calls[i]()
        except Exception as exc:  # reported in the JSON, not raised
            results[i] = exc

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    deadline = start + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
        if t.is_alive():
            return None, results
    return time.perf_counter() - start, results


def ours(nodes: int, run_id: str, timeout: float, conf: dict[str, str]) -> dict[str, Any]:
    from elastic.core.interfaces.rendezvous import RendezvousParameters
    from elastic.plugins.rdzv_c10d import create_handler

    port = free_port()
    t0 = time.perf_counter()
    handlers = [
        create_handler(
            RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, nodes, nodes, config=conf)
        )
        for _ in range(nodes)
    ]
    connect = time.perf_counter() - t0
    elapsed, results = run_threads([h.next_rendezvous for h in handlers], timeout)
    errors = [repr(r) for r in results if isinstance(r, Exception)]
    ranks = sorted(r.rank for r in results if hasattr(r, "rank"))
    ok = elapsed is not None and not errors and ranks == list(range(nodes))
    # End as a finished job does: closed, then every node out ("done"), the store's host
    # (first) last, so it does not wait for the others.
    t1 = time.perf_counter()
    handlers[0].set_closed()
    for h in reversed(handlers):
        h.shutdown()
    return {
        "seconds": elapsed if ok else None,
        "connect_seconds": connect,
        "shutdown_seconds": time.perf_counter() - t1,
        "errors": errors[:3],
    }


def torchs(nodes: int, run_id: str, timeout: float) -> dict[str, Any]:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    port = free_port()
    t0 = time.perf_counter()
    server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=600), use_libuv=True)
    handlers = []
    for _ in range(nodes):
        client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=600))
        handlers.append(
            DynamicRendezvousHandler.from_backend(
                run_id,
                client,
                C10dRendezvousBackend(client, run_id),
                nodes,
                nodes,
                timeout=RendezvousTimeout(join=timedelta(seconds=timeout + 60)),
            )
        )
    connect = time.perf_counter() - t0
    elapsed, results = run_threads([h.next_rendezvous for h in handlers], timeout)
    errors = [repr(r) for r in results if isinstance(r, Exception)]
    ok = elapsed is not None and not errors
    # Unfinished handlers keep running in daemon threads; the process exits with os._exit.
    _keep_alive.append((server, handlers))
    return {"seconds": elapsed if ok else None, "connect_seconds": connect, "errors": errors[:3]}


_keep_alive: list[Any] = []


def add_ratio(report: dict[str, Any], torch_timeout: float) -> None:
    """torch's median over ours; a bound when torch's handlers did not finish."""
    a, b = report["ours"]["median"], report["torch"]["median"]
    if a and b:
        report["ratio"] = round(b / a, 1)
    elif a:
        report["ratio"] = f"> {torch_timeout / a:.0f} (torch did not finish)"


def summary(runs: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    times = [r["seconds"] for r in runs if r["seconds"] is not None]
    out: dict[str, Any] = {
        "runs": [None if r["seconds"] is None else round(r["seconds"], 4) for r in runs],
        "connect_seconds": [round(r["connect_seconds"], 3) for r in runs],
        "shutdown_seconds": [
            round(r["shutdown_seconds"], 3) for r in runs if "shutdown_seconds" in r
        ],
    }
    if len(times) == len(runs):
        out["median"] = round(statistics.median(times), 4)
        out["spread"] = [round(min(times), 4), round(max(times), 4)]
    else:
        out["median"] = None
        out["result"] = f"did not finish within {timeout:g} s"
        errors = [e for r in runs for e in r["errors"]]
        if errors:
            out["errors"] = errors[:3]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="c10d", choices=["c10d"])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="cap for ours (s)")
    parser.add_argument("--torch-timeout", type=float, default=120.0, help="cap for torch's")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's handler")
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--rdzv-conf pair for our handlers (repeatable); default: product defaults",
    )
    args = parser.parse_args(argv)

    fd_limit = raise_fd_limit(args.nodes)
    conf = dict(pair.split("=", 1) for pair in args.conf)
    mine = [ours(args.nodes, f"ours-{i}", args.timeout, conf) for i in range(args.repeat)]
    report: dict[str, Any] = {
        "backend": args.backend,
        "nodes": args.nodes,
        "repeat": args.repeat,
        "clients": "connected before the clock; RES_OPTIONS=" + os.environ["RES_OPTIONS"],
        "fd_limit": fd_limit,
        "rdzv_conf": conf,
        "cpus": os.cpu_count(),
        "ours": summary(mine, args.timeout),
    }
    if not args.no_torch:
        theirs = []
        for i in range(args.repeat):
            theirs.append(torchs(args.nodes, f"torch-{i}", args.torch_timeout))
            if theirs[-1]["seconds"] is None:
                break  # one timeout says enough; repeating only burns the cap again
        report["torch"] = summary(theirs, args.torch_timeout)
        add_ratio(report, args.torch_timeout)
    print(json.dumps(report, indent=2))
    sys.stdout.flush()
    os._exit(0)  # torch's unfinished handler threads must not keep us alive


if __name__ == "__main__":
    main()
