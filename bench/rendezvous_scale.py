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
import sys
import time
from datetime import timedelta
from typing import Any

from elastic.testing.benchmarking import (
    add_rendezvous_scale_options,
    add_torch_runs,
    rendezvous_summary,
    time_rendezvous,
)
from elastic.testing.ports import free_port
from elastic.testing.processes import raise_nofile

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
    for h in reversed(timing.handlers):
        h.shutdown()
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
    args = parser.parse_args(argv)

    fd_limit = raise_nofile(4 * args.nodes + 256)[0]  # ~2 connections a handler, both ends
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
    if not args.no_torch:

        def run(run_id: str) -> dict[str, Any]:
            return torchs(args.nodes, run_id, args.torch_timeout)

        add_torch_runs(report, run, args.repeat, args.torch_timeout)
    print(json.dumps(report, indent=2))
    sys.stdout.flush()
    os._exit(0)  # torch's unfinished handler threads must not keep us alive


if __name__ == "__main__":
    main()
