"""Real agents (ours or torchrun) and real etcd on a simulated cluster, for fault tests and
the fault bench (``tests/test_faults.py``, ``bench/faults.py``).

A ``FaultJob`` starts one launcher per host (``host.popen``), every agent's output going to
``<workdir>/<host>.log``, with ``WORKER`` as the training script: each worker writes one
JSON record when it starts (``start-<host>-<pid>.json``: wall time before any import, host,
ranks, restart count, this round's master address) and then waits for the job's stop file,
optionally all-reducing over gloo meanwhile (``gloo=True``). All hosts share one clock, so
"the survivors' workers run again N s after the fault" is a difference of ``time.time()``
values: the fault's and the first start record of a later round on every survivor.

``start_etcd(hosts, workdir)`` runs an etcd member on each of ``hosts`` (their own
addresses, ports 2379/2380) and returns once the cluster answers; it dies with its hosts.
``serve_rendezvous(cluster, backend, workdir)`` picks the job's hosts and endpoint (etcd on
the hosts left over), and ``FaultJob.start_together(hosts, timeout)`` starts the agents
and waits for their first round: the set-up every fault test and bench shares.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.harness.cluster import ETC_NETNS, Cluster, Host
from elastic.harness.processes import launcher_cmd
from elastic.harness.records import read_records
from elastic.testing.etcd import ETCD_BINARY
from elastic.testing.waits import wait_until

ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
C10D_PORT = 29400

# Both workers' first lines: one start record per worker process, ``t0`` its time.
START_RECORD = """\
out = os.environ["FAULTS_OUT"]
rec = {
    "t": t0,
    "host": socket.gethostname(),
    "pid": os.getpid(),
    "rank": int(os.environ["RANK"]),
    "world": int(os.environ["WORLD_SIZE"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    "master": os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"],
}
path = os.path.join(out, f"start-{rec['host']}-{rec['pid']}.json")
with open(path + ".tmp", "w") as f:
    json.dump(rec, f)
os.rename(path + ".tmp", path)  # readers never see half a record
"""

WORKER = (
    """\
import json, os, signal, socket, sys, time
t0 = time.time()
"""
    + START_RECORD
    + """\
print("WORKER", json.dumps(rec), flush=True)


def on_sigterm(signum, frame):  # the agent stops us: record when
    gone = dict(rec, t=time.time())
    with open(os.path.join(out, f"stopped-{rec['host']}-{rec['pid']}.json"), "w") as f:
        json.dump(gone, f)
    os._exit(128 + signum)


stop = os.path.join(out, "stop")
if os.environ.get("FAULTS_GLOO") != "1":
    # A Python handler runs only between bytecodes: one blocked in a collective would wait
    # for the agent's SIGKILL. Gloo workers keep SIGTERM's default, as most scripts do.
    signal.signal(signal.SIGTERM, on_sigterm)
if os.environ.get("FAULTS_GLOO") == "1":
    import datetime
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1)
    progress = os.path.join(out, f"progress-{rec['host']}-{rec['pid']}")
    open(progress, "w").close()
    while True:
        dist.all_reduce(t)
        os.utime(progress)  # its mtime: when this worker last finished a collective
        flag = torch.tensor([float(os.path.exists(stop))])
        dist.all_reduce(flag)  # everyone leaves the loop in the same step
        if flag.item() > 0:
            break
        time.sleep(0.1)
    dist.destroy_process_group()
else:
    while not os.path.exists(stop):
        time.sleep(0.05)
print("WORKER-DONE", rec["host"], flush=True)
"""
)


@dataclass
class Node:
    host: Host
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


@dataclass
class FaultJob:
    """One job of ``nnodes`` agents of ``launcher`` over ``backend`` on ``cluster``.

    ``endpoint`` is ``--rdzv-endpoint`` (a host name, e.g. ``f"{hosts[0].name}:29400"``);
    ``conf`` the ``--rdzv-conf`` items; ``args`` any further launcher flags."""

    cluster: Cluster
    workdir: Path
    backend: str
    endpoint: str
    launcher: str = "ours"
    nnodes: str = "2:3"
    conf: dict[str, Any] = field(default_factory=dict)
    args: Sequence[str] = ()
    gloo: bool = False
    script: Path | None = None  # None: ``WORKER``
    script_args: Sequence[str] = ()
    run_id: str = "faults"
    env: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name_mapped_addresses(self.cluster)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.script is None:
            self.script = self.workdir / "worker.py"
            self.script.write_text(WORKER)
        self.stop_file = self.workdir / "stop"

    def command(self) -> list[str]:
        conf = ",".join(f"{k}={v}" for k, v in self.conf.items())
        return [
            *launcher_cmd(self.launcher),
            f"--nnodes={self.nnodes}",
            "--nproc-per-node=1",
            f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            *([f"--rdzv-conf={conf}"] if conf else []),
            "--monitor-interval=0.1",
            *self.args,
            str(self.script),
            *self.script_args,
        ]

    def start(self, host: Host) -> Node:
        env = dict(os.environ, PYTHONUNBUFFERED="1", FAULTS_OUT=str(self.workdir))
        env["FAULTS_GLOO"] = "1" if self.gloo else "0"
        env.update(self.env)
        log = self.workdir / f"{host.name}.log"
        with open(log, "ab") as out:
            out.write(f"$ {shlex.join(self.command())}\n".encode())
            out.flush()
            proc = host.popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env)
        self.nodes[host.name] = node = Node(host, proc, log)
        return node

    def start_together(self, hosts: Sequence[Host], timeout: float) -> bool:
        """Start an agent on each of ``hosts``; whether they run as one round of all of
        them within ``timeout`` s."""
        for host in hosts:
            self.start(host)
        return wait_until(lambda: self.running_together(hosts), timeout)

    def starts(self) -> list[dict[str, Any]]:
        """Every worker start so far, oldest first."""
        return read_records(self.workdir, "start-*.json")

    def stops(self, host: Host) -> list[dict[str, Any]]:
        """When ``host``'s workers were stopped by SIGTERM (their agent's), oldest first;
        not recorded for gloo workers."""
        return read_records(self.workdir, f"stopped-{host.name}-*.json")

    def progressed_at(self, record: dict[str, Any]) -> float | None:
        """When the (gloo) worker of start ``record`` last finished a collective."""
        try:
            return (self.workdir / f"progress-{record['host']}-{record['pid']}").stat().st_mtime
        except OSError:
            return None

    def latest(self, host: Host) -> dict[str, Any] | None:
        mine = [r for r in self.starts() if r["host"] == host.name]
        return mine[-1] if mine else None

    def running_together(self, hosts: Sequence[Host], since: float = 0.0) -> bool:
        """Whether each of ``hosts`` started a worker after ``since`` and the latest ones
        are all of one round (one master address) of exactly ``len(hosts)`` nodes."""
        latest = [self.latest(h) for h in hosts]
        if any(r is None or r["t"] <= since for r in latest):
            return False
        rounds = {(r["master"], r["world"]) for r in latest if r is not None}
        return len(rounds) == 1 and next(iter(rounds))[1] == len(hosts)

    def regroup_time(self, hosts: Sequence[Host], since: float) -> float:
        """Seconds from ``since`` until the last of ``hosts`` started its worker of the
        round they share now."""
        return max(r["t"] for r in map(self.latest, hosts) if r is not None) - since

    def texts(self) -> str:
        return "\n".join(f"--- {name}\n{node.text()[-3000:]}" for name, node in self.nodes.items())

    def finish(self) -> None:
        self.stop_file.touch()


class ExitWatch:
    """When each of ``pids`` exited (``time.time()``), polled every 10 ms from a thread:
    a process that is gone or a zombie (exited, not reaped yet) has exited. The hosts
    are network namespaces only, so their pids are this machine's."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.exited: dict[int, float] = {}
        self._pids = list(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.exited) < len(self._pids):
            for pid in self._pids:
                if pid not in self.exited and not _running(pid):
                    self.exited[pid] = time.time()
            self._stop.wait(0.01)

    def all_exited(self) -> float | None:
        """When the last of them exited, or None while one runs."""
        if len(self.exited) < len(self._pids):
            return None
        return max(self.exited.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def c10d_script_job(
    cluster: Cluster,
    workdir: Path,
    source: str,
    script_args: list[str],
    *,
    run_id: str,
    nnodes: str,
    args: list[str],
    launcher: str = "ours",
    env: dict[str, str] | None = None,
) -> FaultJob:
    """A c10d job (hosted by the first host, a 1 s last call) running the worker
    ``source``, written to ``workdir/<run_id>_worker.py``, on every host (not started)."""
    script = workdir / f"{run_id}_worker.py"
    script.write_text(source)
    return FaultJob(
        cluster,
        workdir / "job",
        "c10d",
        f"{cluster.hosts[0].name}:{C10D_PORT}",
        launcher=launcher,
        nnodes=nnodes,
        conf={"last_call_timeout": 1},
        args=args,
        script=script,
        script_args=script_args,
        run_id=run_id,
        env=env or {},
    )


def name_mapped_addresses(cluster: Cluster) -> None:
    """Name every host's IPv4-mapped IPv6 address in the hosts' ``/etc/hosts`` as well.

    torch's TCPStore (in the workers: gloo's rendezvous at MASTER_ADDR) uses dual-stack
    sockets, so peers show up as ``::ffff:198.18.0.x``, and it reverse-resolves them for its
    log lines; glibc's files backend does not map those to the IPv4 lines, asks DNS, and
    torch warns "[c10d] The hostname of the client socket cannot be retrieved. err=-3"
    on every connection. A real host with reverse DNS answers those queries; here the
    hosts file does. Idempotent."""
    for host in cluster.hosts:
        hosts_file = ETC_NETNS / host.netns / "hosts"
        text = hosts_file.read_text()
        if "::ffff:" in text:
            continue
        mapped = "::ffff:127.0.0.1 localhost\n"
        mapped += "".join(f"::ffff:{h.addr} {h.name}\n" for h in cluster.hosts)
        hosts_file.write_text(text + mapped)


def etcd_endpoint(hosts: Sequence[Host]) -> str:
    return ",".join(f"{h.name}:{ETCD_CLIENT_PORT}" for h in hosts)


def serve_rendezvous(
    cluster: Cluster, backend: str, workdir: Path, nodes: int = 3
) -> tuple[list[Host], str]:
    """The job's hosts (the first ``nodes`` of ``cluster``) and its ``--rdzv-endpoint``.
    c10d: the store the agent on the first host hosts. An etcd backend: an etcd member on
    every other host, started here (serving the v2 API for ``etcd-v2`` and ``etcd``), so
    a node lost never takes the store with it."""
    hosts = list(cluster.hosts[:nodes])
    if backend == "c10d":
        return hosts, f"{hosts[0].name}:{C10D_PORT}"
    etcd_hosts = cluster.hosts[nodes:]
    start_etcd(etcd_hosts, workdir, v2=backend in ("etcd-v2", "etcd"))
    return hosts, etcd_endpoint(etcd_hosts)


def start_etcd(
    hosts: Sequence[Host], workdir: Path, v2: bool = False, timeout: float = 30.0
) -> list[subprocess.Popen[bytes]]:
    """One etcd member per host, on the host's own address; returns once healthy."""
    initial = ",".join(f"m{h.index}=http://{h.addr}:{ETCD_PEER_PORT}" for h in hosts)
    procs = []
    for host in hosts:
        client, peer = f"http://{host.addr}:{ETCD_CLIENT_PORT}", f"http://{host.addr}:2380"
        cmd = [
            ETCD_BINARY,
            "--name", f"m{host.index}",
            "--data-dir", str(workdir / f"etcd-{host.name}"),
            *(["--enable-v2"] if v2 else []),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", initial,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"faults-{hosts[0].name}",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--log-level", "warn",
        ]  # fmt: skip
        with open(workdir / f"etcd-{host.name}.log", "ab") as out:
            procs.append(host.popen(cmd, stdout=out, stderr=subprocess.STDOUT))
    check = "import sys, urllib.request as u; u.urlopen(sys.argv[1] + '/health', timeout=1).read()"
    deadline = time.monotonic() + timeout
    for host in hosts:
        url = f"http://{host.addr}:{ETCD_CLIENT_PORT}"
        while host.run([sys.executable, "-c", check, url], timeout=10).returncode != 0:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                logs = [(workdir / f"etcd-{h.name}.log").read_text()[-800:] for h in hosts]
                raise RuntimeError(f"etcd did not become healthy: {logs}")
            time.sleep(0.1)
    return procs


# A gloo DDP job that checkpoints on a preemption notice (``elastic.checkpoint_requested()``
# every step, agreed with one all_reduce MAX, as the README shows) and, with ``EVERY`` > 0,
# also every ``EVERY`` steps (what a torchrun job does, having no notice). For
# ``tests/test_preemption_multihost.py`` and ``bench/preemption.py``:
#
#     PREEMPT_WORKER CKPT_DIR STEPS EVERY PAUSE     (under a launcher, FAULTS_OUT set)
#     PREEMPT_WORKER --reference STEPS              (one process: prints the final weights)
#
