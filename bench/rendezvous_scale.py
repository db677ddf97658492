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
import functools
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastic.harness.benchmarking import (
    add_rendezvous_scale_options,
    add_torch_runs,
    rendezvous_summary,
    shut_down,
    time_rendezvous,
)
from elastic.harness.processes import raise_nofile
from elastic.testing.ports import free_port

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # before any resolver use


def ours(nodes: int, run_id: str, timeout: float, conf: dict[str, str]) -> dict[str, Any]:
    from elastic.core.interfaces.rendezvous import RendezvousParameters
    from elastic.plugins.rdzv_c10d import create_handler

    endpoint = f"127.0.0.1:{free_port()}"

    def create_handlers() -> list[Any]:
        return [
            create_handler(
                RendezvousParameters("c10d", endpoint, run_id, nodes, nodes, config=conf)
            )
            for _ in range(nodes)
        ]

    timing = time_rendezvous(create_handlers, timeout)
    # End as a finished job does: closed, then every node out ("done"), the store's host
    # (first) last, so it does not wait for the others.
    t1 = time.perf_counter()
    timing.handlers[0].set_closed()
    shut_down(timing.handlers, last=timing.handlers[0])
    return {**timing.result(), "shutdown_seconds": time.perf_counter() - t1}


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
    servers = []

    def create_handlers() -> list[Any]:
        servers.append(
            TCPStore("127.0.0.1", port, None, True, timedelta(seconds=600), use_libuv=True)
        )
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
        return handlers

    timing = time_rendezvous(create_handlers, timeout, check_ranks=False)
    _keep_alive.append((servers, timing.handlers))
    return timing.result()


class Phases:
    """When each of our handlers reached each step of its first round (seconds after
    the first entered ``next_rendezvous``), by wrapping the round's methods: where the
    timed region goes. ``summary()``: first / median / 90th percentile / last per step."""

    STEPS = (
        # (module under elastic.core.rendezvous.round, class, method, mark before, after)
        ("handler", "RoundRendezvousHandler", "next_rendezvous", "entered", "returned"),
        ("monitor", "Monitor", "start", None, "monitor started (first keep-alive, threads)"),
        ("joining", "Joiner", "find_coordinator", "joined (slot, record)", None),
        ("publishing", "RoundOutcomes", "publish", None, "outcome published"),
        ("joining", "Joiner", "await_outcome", None, "outcome seen"),
    )

    def __init__(self) -> None:
        self.marks: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._undo: list[tuple[type, str, Callable[..., Any]]] = []

    def __enter__(self) -> Phases:
        for module, cls_name, name, before, after in self.STEPS:
            cls = getattr(
                importlib.import_module(f"elastic.core.rendezvous.round.{module}"), cls_name
            )
            original = getattr(cls, name)
            setattr(cls, name, self._wrap(original, before, after))
            self._undo.append((cls, name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in self._undo:
            setattr(cls, name, original)

    def _mark(self, step: str) -> None:
        with self._lock:
            self.marks.setdefault(step, []).append(time.perf_counter())

    def _wrap(self, fn: Callable[..., Any], before: str | None, after: str | None) -> Any:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before:
                self._mark(before)
            try:
                return fn(*args, **kwargs)
            finally:
                if after:
                    self._mark(after)

        return wrapped

    def summary(self) -> dict[str, list[float]]:
        start, end = min(self.marks["entered"]), max(self.marks["returned"])
        out = {}
        for step, times in self.marks.items():
            t = sorted(x - start for x in times if x <= end)  # not the shutdown's
            if not t:
                continue
            out[f"{step} (n={len(t)})"] = [
                round(t[min(len(t) - 1, int(q * len(t)))], 3) for q in (0, 0.5, 0.9, 1)
            ]
        return out


# torch's unfinished handlers run on in daemon threads: keep them (and their store) alive
# until the process exits with os._exit.
_keep_alive: list[Any] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="c10d", choices=["c10d"])
    add_rendezvous_scale_options(parser)
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--rdzv-conf pair for our handlers (repeatable); default: product defaults",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each step of our handlers' round (one more run, not in the median)",
    )
    args = parser.parse_args(argv)

    # Per handler: 4 connections to the store (both ends), a standby store, a presence port.
    fd_limit = raise_nofile(12 * args.nodes + 256)[0]
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
        "ours": rendezvous_summary(mine, args.timeout),
    }
    if args.phases:
        with Phases() as phases:
            traced = ours(args.nodes, "ours-phases", args.timeout, conf)
        report["ours_phases"] = {
            "seconds": traced["seconds"] and round(traced["seconds"], 4),
            "steps [first, median, p90, last] s": phases.summary(),
        }
    if not args.no_torch:

        def run(run_id: str) -> dict[str, Any]:
            return torchs(args.nodes, run_id, args.torch_timeout)

        add_torch_runs(report, run, args.repeat, args.torch_timeout)
    print(json.dumps(report, indent=2))
    sys.stdout.flush()
    os._exit(0)  # torch's unfinished handler threads must not keep us alive


if __name__ == "__main__":
    main()
