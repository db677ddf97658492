"""Rendezvous at scale over etcd: N handlers as threads of one process, one loopback etcd.

    python bench/rendezvous_scale_etcd.py --backend etcd-v2 --nodes 64 --repeat 3

Same CLI and JSON shape as bench/rendezvous_scale.py (whose helpers it reuses). Runs N of
our handlers and N of torch's equivalent (``etcd-v2`` and ``etcd-v3``: torch's
DynamicRendezvousHandler over its EtcdRendezvousBackend, v2 API: torch has no v3 backend;
``etcd``: torch's EtcdRendezvousHandler) against the same
freshly started etcd (``--enable-v2``, loopback, temp data dir), each run under its own run
id, min = max = N. Handlers (and their HTTP clients) are created before the clock starts;
creation time is reported as ``connect_seconds``. The timed region is from releasing all N
threads into next_rendezvous() until the last returns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rendezvous_scale as base  # noqa: E402 - reuse the c10d bench's timing helpers


def ours(backend: str, endpoint: str, nodes: int, run_id: str, timeout: float) -> dict[str, Any]:
    import time

    from elastic.core.interfaces.rendezvous import RendezvousParameters
    from elastic.core.rendezvous.registry import get_rendezvous_handler

    t0 = time.perf_counter()
    handlers = [
        get_rendezvous_handler(
            RendezvousParameters(backend, endpoint, run_id, nodes, nodes, local_addr="127.0.0.1")
        )
        for _ in range(nodes)
    ]
    connect = time.perf_counter() - t0
    elapsed, results = base.run_threads([h.next_rendezvous for h in handlers], timeout)
    errors = [repr(r) for r in results if isinstance(r, Exception)]
    ranks = sorted(r.rank for r in results if hasattr(r, "rank"))
    ok = elapsed is not None and not errors and ranks == list(range(nodes))
    for h in handlers:
        h.shutdown()
    return {"seconds": elapsed if ok else None, "connect_seconds": connect, "errors": errors[:3]}


def torchs(backend: str, endpoint: str, nodes: int, run_id: str, timeout: float) -> dict[str, Any]:
    import time
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import RendezvousParameters as TorchParams
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
    from torch.distributed.elastic.rendezvous import etcd_rendezvous, etcd_rendezvous_backend

    t0 = time.perf_counter()
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
    connect = time.perf_counter() - t0
    elapsed, results = base.run_threads([h.next_rendezvous for h in handlers], timeout)
    errors = [repr(r) for r in results if isinstance(r, Exception)]
    ok = elapsed is not None and not errors
    base._keep_alive.append(handlers)  # unfinished ones keep running in daemon threads
    return {"seconds": elapsed if ok else None, "connect_seconds": connect, "errors": errors[:3]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backend", default="etcd-v2", choices=["etcd-v3", "etcd-v2", "etcd"])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="cap for ours (s)")
    parser.add_argument("--torch-timeout", type=float, default=120.0, help="cap for torch's")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's handler")
    args = parser.parse_args(argv)

    from elastic.testing.etcd import EtcdCluster

    # etcd runs in its own session: turn SIGTERM into an exit so `finally` stops it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fd_limit = base.raise_fd_limit(args.nodes * 4)
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
            "ours": base.summary(mine, args.timeout),
        }
        if not args.no_torch:
            theirs = []
            for i in range(args.repeat):
                # torch has no v3 backend: its etcd-v2 handler is the peer of our etcd-v3.
                peer = "etcd-v2" if args.backend == "etcd-v3" else args.backend
                theirs.append(torchs(peer, endpoint, args.nodes, f"torch-{i}", args.torch_timeout))
                if theirs[-1]["seconds"] is None:
                    break  # one timeout says enough
            report["torch"] = base.summary(theirs, args.torch_timeout)
            base.add_ratio(report, args.torch_timeout)
        print(json.dumps(report, indent=2))
        sys.stdout.flush()
    finally:
        server.stop()
    os._exit(0)  # torch's unfinished handlers may still be running in daemon threads


if __name__ == "__main__":
    sys.exit(main())
