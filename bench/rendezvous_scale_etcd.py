"""Rendezvous at scale over etcd: N handlers as threads of one process, one loopback etcd.

    python bench/rendezvous_scale_etcd.py --backend etcd-v2 --nodes 64 --repeat 3

Same CLI, JSON shape and timing helpers (``elastic.harness.benchmarking``) as
bench/rendezvous_scale.py. Runs N of our handlers and N of torch's equivalent (``etcd-v2``
and ``etcd-v3``: torch's DynamicRendezvousHandler over its EtcdRendezvousBackend, v2 API:
torch has no v3 backend; ``etcd``: torch's EtcdRendezvousHandler) against the same freshly
started etcd (``--enable-v2``, loopback, temp data dir), each run under its own run id,
min = max = N. Handlers (and their HTTP clients) are created before the clock starts;
creation time is reported as ``connect_seconds``. The timed region is from releasing all N
threads into next_rendezvous() until the last returns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from elastic.harness.benchmarking import (
    add_rendezvous_scale_options,
    add_torch_runs,
    rendezvous_summary,
    shut_down,
    time_rendezvous,
)
from elastic.harness.processes import raise_nofile
from elastic.testing.etcd import EtcdCluster

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # as in rendezvous_scale.py

# torch's unfinished handlers run on in daemon threads: keep them alive until os._exit.
_keep_alive: list[Any] = []


def ours(backend: str, endpoint: str, nodes: int, run_id: str, timeout: float) -> dict[str, Any]:

    from elastic.core.interfaces.rendezvous import RendezvousParameters
    from elastic.core.rendezvous.registry import get_rendezvous_handler

    def create_handlers() -> list[Any]:
        return [
            get_rendezvous_handler(
                RendezvousParameters(
                    backend, endpoint, run_id, nodes, nodes, local_addr="127.0.0.1"
                )
            )
            for _ in range(nodes)
        ]

    timing = time_rendezvous(create_handlers, timeout)
    shut_down(timing.handlers)
    return timing.result()


def torchs(backend: str, endpoint: str, nodes: int, run_id: str, timeout: float) -> dict[str, Any]:
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import RendezvousParameters as TorchParams
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
    from torch.distributed.elastic.rendezvous import etcd_rendezvous, etcd_rendezvous_backend

    def create_handlers() -> list[Any]:
        handlers = []
        for _ in range(nodes):
            params = TorchParams(
                backend, endpoint, run_id, nodes, nodes, local_addr="127.0.0.1",
                timeout=int(timeout + 60),
            )  # fmt: skip
            if backend == "etcd":
                handlers.append(etcd_rendezvous.create_rdzv_handler(params))
            else:
                store_backend, store = etcd_rendezvous_backend.create_backend(params)
                handlers.append(
                    dyn.DynamicRendezvousHandler.from_backend(
                        run_id,
                        store,
                        store_backend,
                        nodes,
                        nodes,
                        timeout=dyn.RendezvousTimeout(join=timedelta(seconds=timeout + 60)),
                    )  # fmt: skip
                )
        return handlers

    timing = time_rendezvous(create_handlers, timeout, check_ranks=False)
    _keep_alive.append(timing.handlers)
    return timing.result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backend", default="etcd-v2", choices=["etcd-v3", "etcd-v2", "etcd"])
    add_rendezvous_scale_options(parser)
    args = parser.parse_args(argv)

    # etcd runs in its own session: turn SIGTERM into an exit so `finally` stops it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fd_limit = raise_nofile(16 * args.nodes + 256)[0]
    server = EtcdCluster(1).start()
    try:
        endpoint = server.endpoint
        mine = [
            ours(args.backend, endpoint, args.nodes, f"ours-{i}", args.timeout)
            for i in range(args.repeat)
        ]
        report: dict[str, Any] = {
            "backend": args.backend,
            "nodes": args.nodes,
            "repeat": args.repeat,
            "clients": "handlers created before the clock; one loopback etcd 3.4 (--enable-v2)",
            "fd_limit": fd_limit,
            "cpus": os.cpu_count(),
            "ours": rendezvous_summary(mine, args.timeout),
        }
        if not args.no_torch:
            # torch has no v3 backend: its etcd-v2 handler is the peer of our etcd-v3.
            peer = "etcd-v2" if args.backend == "etcd-v3" else args.backend

            def run(run_id: str) -> dict[str, Any]:
                return torchs(peer, endpoint, args.nodes, run_id, args.torch_timeout)

            add_torch_runs(report, run, args.repeat, args.torch_timeout)
        print(json.dumps(report, indent=2))
        sys.stdout.flush()
    finally:
        server.stop()
    os._exit(0)  # torch's unfinished handlers may still be running in daemon threads


if __name__ == "__main__":
    sys.exit(main())
