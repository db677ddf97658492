"""A store process paused (SIGSTOP, then SIGCONT) under a formed round: who fences?

N nodes' round monitors (``core/rendezvous/round/monitor.py``, each with a connection of
its own and one for its keep-alives, as an agent has) run in this process against a store
in another: a ``TCPStoreServer`` (c10d) or a single etcd server (etcd-v3). Once the round
has run for a few seconds the store's process is stopped for each of ``--pauses`` seconds
in turn; after ``--after`` s more, every node is asked ``fenced()`` (its lease ran out,
or the others published it lost). Nobody is cut off, so the right answer is 0 fenced
while a pause is shorter than the lease (heartbeat_timeout - 1 s; on c10d a keep-alive
waiting in a paused store is waited for up to read_timeout, 10 s). Default settings unless
``--heartbeat-timeout``/``--heartbeat-interval`` say otherwise.

    python bench/store_pause.py --nodes 16 --pauses 1,3,4,6
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.monitor import Monitor
from elastic.core.tcpstore.view import Connection, PrefixStore

HOST = "127.0.0.1"
SERVER = """\
import sys, time
from elastic.core.tcpstore import TCPStoreServer
server = TCPStoreServer(sys.argv[1], 0)
print(server.port, flush=True)
time.sleep(3600)
"""


def c10d_store() -> tuple[subprocess.Popen[str], Any, Any]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, HOST], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())

    def store(lease: bool) -> PrefixStore:  # read_timeout's default, as the handler's
        return PrefixStore(Connection(HOST, port, timeout=10.0), "job/")

    return proc, store, None


def etcd_store() -> tuple[subprocess.Popen[bytes], Any, Any]:
    from elastic.plugins.rdzv_etcd_v3.client import V3Config
    from elastic.plugins.rdzv_etcd_v3.store import EtcdV3Store
    from elastic.testing.etcd import EtcdCluster

    cluster = EtcdCluster(1, v2=False)
    cluster.start()
    config = V3Config(cluster.endpoint, read_timeout=5 / 3)

    def store(lease: bool) -> EtcdV3Store:
        return EtcdV3Store(config, "/job/", lease_ttl=10)

    proc = cluster.members[0].proc
    assert proc is not None
    return proc, store, cluster


def run(backend: str, nodes: int, pause: float, after: float, interval: float, timeout: float):
    proc, make, cluster = c10d_store() if backend == "c10d" else etcd_store()
    names = [f"n{i}" for i in range(nodes)]
    asg = R.Assignment(round=0, state="formed", members=names)
    monitors = []
    try:
        for name in names:
            monitor = Monitor(make(False), name, interval, timeout, lease_store=make(True))
            monitor.start()
            monitors.append(monitor)
        for rank, monitor in enumerate(monitors):
            monitor.set_round(asg, rank)
        time.sleep(3 * interval + 1)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(pause)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(after)
        reasons = [m.fenced("the store") for m in monitors]
        for why in sorted({r.split(":")[0].split(" (")[0] for r in reasons if r}):
            print(f"  {backend}, paused {pause:g} s: {why}", file=sys.stderr)
        return sum(r is not None for r in reasons)
    finally:
        for monitor in monitors:
            monitor.stop(wait=False)
        if cluster is not None:
            cluster.stop()
        else:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--pauses", default="1,3,4,6")
    parser.add_argument("--after", type=float, default=7.0)
    parser.add_argument("--backends", default="c10d,etcd-v3")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    args = parser.parse_args()
    pauses = [float(p) for p in args.pauses.split(",")]
    print(f"$ {' '.join(sys.argv)}   (load {os.getloadavg()[0]:.2f})")
    print(f"| backend | {' | '.join(f'paused {p:g} s' for p in pauses)} |")
    print(f"| --- | {' | '.join('---' for _ in pauses)} |")
    for backend in args.backends.split(","):
        cells = []
        for pause in pauses:
            fenced = run(
                backend,
                args.nodes,
                pause,
                args.after,
                args.heartbeat_interval,
                args.heartbeat_timeout,
            )
            cells.append(f"{fenced}/{args.nodes} fenced")
        print(f"| {backend} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
