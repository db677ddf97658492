"""The agents of ``agents_scale.py``: ``Job`` (N agents of one launcher on one endpoint,
started, reaped with their rusage, killed) and the two runs made of it, ``scale_run``
(start-up to every agent's exit) and ``heartbeat_run`` (the store host's CPU, its
requests by kind and every agent's peak RSS while they heartbeat). What each measures:
``agents_scale.py``'s docstring."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from elastic.harness.processes import (
    kill_tree,
    launcher_cmd,
    mem_available_mb,
    proc_cpu_seconds,
    proc_status_kb,
    sigkill_group,
)
from elastic.harness.records import read_records
from elastic.testing.ports import free_port, listening_pid

WORKER = Path(__file__).resolve().parent / "workers" / "probe.py"
HEARTBEAT_INTERVAL = {"ours": 1.0, "torchrun": 5.0}  # each launcher's default, seconds

# ``python -c COUNTING_AGENT run ...``: ours, with the store's requests counted by kind.
# The agent that hosts the store rewrites STORE_COUNT_FILE ("<pid> <time> <json counts>")
# every second; the others only carry the (unused) patch, and every agent's standby store
# (c10d's handover) is left out.
COUNTING_AGENT = """
import collections, json, os, sys, threading, time
from elastic.core.tcpstore import server
count = collections.Counter()
handle, init = server.TCPStoreServer._handle, server.TCPStoreServer.__init__
def counted(self, conn, req):
    count[req.query.name] += 1
    return handle(self, conn, req)
def dump(path):
    while True:
        with open(path + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {time.time()} {json.dumps(dict(count))}")
        os.replace(path + ".tmp", path)
        time.sleep(1.0)
def start(self, *args, **kwargs):
    init(self, *args, **kwargs)
    if "data" in kwargs:  # a c10d standby store (born with its mark), not the job's
        return
    path = os.environ["STORE_COUNT_FILE"]
    threading.Thread(target=dump, args=(path,), daemon=True).start()
server.TCPStoreServer._handle, server.TCPStoreServer.__init__ = counted, start
sys.argv = ["elastic", *sys.argv[1:]]
from elastic.cli.main import main
main()
"""


class Job:
    """N agents of one launcher on one endpoint, each in a session of its own."""

    def __init__(
        self,
        impl: str,
        nodes: int,
        mode: str,
        env: dict[str, str],
        work: Path,
        count_requests: bool = False,
        extra: list[str] | None = None,
        python: Path | None = None,
    ) -> None:
        self.impl, self.nodes = impl, nodes
        self.dir = Path(tempfile.mkdtemp(prefix=f"{impl}-{nodes}-", dir=work))
        self.port = free_port()
        launcher = launcher_cmd(impl, python)
        if count_requests and impl == "ours":
            launcher = [str(python or sys.executable), "-c", COUNTING_AGENT, "run"]
            env = {**env, "STORE_COUNT_FILE": str(self.dir / "store-count")}
        self.cmd = [
            *launcher,
            f"--nnodes={nodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id=scale-{uuid.uuid4().hex[:12]}",
            "--max-restarts=0",
            *(extra or []),
            str(WORKER),
            str(self.dir),
            mode,
        ]
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        # index -> (exit code, exit time, CPU s of the agent and its reaped children, maxrss kB)
        self.exits: dict[int, tuple[int, float, float, int]] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.logs = [self.dir / f"agent{i}.log" for i in range(nodes)]
        self.started = 0.0
        self.exits_before_kill: dict[int, tuple[int, float, float, int]] = {}

    def start(self) -> None:
        self.started = time.time()
        for i in range(self.nodes):
            with open(self.logs[i], "wb") as log:
                proc = subprocess.Popen(
                    self.cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            self.procs.append(proc)
            thread = threading.Thread(target=self._reap, args=(i, proc), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _reap(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        _, status, usage = os.wait4(proc.pid, 0)
        stamp = time.time()
        proc.returncode = os.waitstatus_to_exitcode(status)
        with self._lock:
            self.exits[index] = (
                proc.returncode,
                stamp,
                usage.ru_utime + usage.ru_stime,
                usage.ru_maxrss,
            )

    def alive(self) -> int:
        with self._lock:
            return self.nodes - len(self.exits)

    def stamps(self) -> list[dict[str, Any]]:
        return read_records(self.dir, "start-*.json")

    def workers_started(self) -> int:
        return len(list(self.dir.glob("start-*.json")))

    def wait(self, until: Any, deadline: float, min_available_mb: float) -> str | None:
        """Poll every 0.1 s until ``until()``; the reason it stopped early, or None."""
        while not until():
            if time.time() >= deadline:
                return "timed out"
            available = mem_available_mb()
            if available < min_available_mb:
                return f"MemAvailable fell to {available:.0f} MB"
            if self._failed_exit():
                return "an agent exited non-zero"
            time.sleep(0.1)
        return None

    def _failed_exit(self) -> bool:
        with self._lock:
            return any(code != 0 for code, *_ in self.exits.values())

    def kill(self) -> None:
        """SIGKILL every agent's group and descendants, and every worker that recorded
        its pid; then reap the agents."""
        with self._lock:
            self.exits_before_kill = dict(self.exits)
        for proc in self.procs:
            kill_tree(proc.pid)
        for stamp in self.stamps():
            try:
                pid = int(stamp["pid"])
            except (KeyError, ValueError):
                continue
            sigkill_group(pid)
        for thread in self._threads:
            thread.join()

    def failure(self, reason: str) -> dict[str, Any]:
        # What the agents did on their own: the exits before the bench killed the rest.
        codes = {i: self.exits_before_kill[i][0] for i in sorted(self.exits_before_kill)}
        bad = [i for i in range(self.nodes) if codes.get(i, 0) != 0][:3]
        if not bad:
            bad = [0, *[i for i in range(1, self.nodes) if i not in codes][:2]]
        return {
            "ok": False,
            "reason": reason,
            "dir": str(self.dir),
            "agents_exited_before_kill": len(codes),
            "nonzero_exits_before_kill": sum(1 for c in codes.values() if c != 0),
            "workers_started": self.workers_started(),
            "log_tails": {
                f"agent{i}": self.logs[i].read_text(errors="replace")[-1200:] for i in bad
            },
        }


def scale_run(
    impl: str, nodes: int, env: dict[str, str], work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    job = Job(impl, nodes, args.worker, env, work, extra=args.extra[impl], python=args.python)
    try:
        job.start()
        reason = job.wait(lambda: job.alive() == 0, job.started + args.timeout, args.min_mb)
    finally:
        job.kill()
    if reason is None and any(code for code, *_ in job.exits.values()):
        reason = "an agent exited non-zero"
    starts = [s["t"] for s in job.stamps()]
    if reason is None and len(starts) != nodes:
        reason = f"only {len(starts)} of {nodes} workers started"
    if reason is not None:
        return job.failure(reason)
    cpus = [cpu for _, _, cpu, _ in job.exits.values()]
    return {
        "ok": True,
        "dir": str(job.dir),
        "workers": max(starts) - job.started,
        "wall": max(t for _, t, _, _ in job.exits.values()) - job.started,
        "cpu_median": statistics.median(cpus),
        "cpu_total": sum(cpus),
        "maxrss_kb_median": statistics.median(rss for *_, rss in job.exits.values()),
    }


def read_count(path: Path) -> tuple[dict[str, int], float] | None:
    """The store host's request counts by kind, and when it wrote them."""
    try:
        _, stamp, counts = path.read_text().split(" ", 2)
        return json.loads(counts), float(stamp)
    except (OSError, ValueError):
        return None


def heartbeat_run(
    impl: str, nodes: int, env: dict[str, str], work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    hold = args.timeout + args.settle + args.heartbeat_seconds + 60
    count = args.count_requests and impl == "ours"
    job = Job(
        impl,
        nodes,
        f"sleep:{hold:g}",
        env,
        work,
        count_requests=count,
        extra=args.extra[impl],
        python=args.python,
    )
    try:
        job.start()
        reason = job.wait(
            lambda: job.workers_started() == nodes, job.started + args.timeout, args.min_mb
        )
        if reason is not None:
            return job.failure(reason)
        up = time.time() - job.started
        time.sleep(args.settle)
        pids = [p.pid for p in job.procs]
        host = listening_pid(job.port, pids)
        if host is None:
            return job.failure(f"no agent listens on port {job.port}")
        count_file = job.dir / "store-count"
        # Let the host write its counter once after the settle, then start the interval
        # right after a write, so the counter's age does not skew the rate.
        before_count = read_count(count_file) if count else None
        t0 = time.time()
        cpu0 = {pid: proc_cpu_seconds(pid) for pid in pids}
        time.sleep(args.heartbeat_seconds)
        t1 = time.time()
        cpu1 = {pid: proc_cpu_seconds(pid) for pid in pids}
        after_count = read_count(count_file) if count else None
        hwm = {pid: proc_status_kb(pid, "VmHWM") for pid in pids}
        alive = job.alive()
    finally:
        job.kill()
    if alive != nodes:
        return job.failure(f"{nodes - alive} agents exited during the interval")
    span = t1 - t0
    interval = HEARTBEAT_INTERVAL[impl]
    host_cpu = (cpu1[host] or 0.0) - (cpu0[host] or 0.0)
    others = [
        (cpu1[p] or 0.0) - (cpu0[p] or 0.0) for p in pids if p != host and cpu0[p] is not None
    ]
    rss_mb = [kb / 1024 for kb in hwm.values() if kb is not None]
    result: dict[str, Any] = {
        "ok": True,
        "dir": str(job.dir),
        "workers_up_s": round(up, 3),
        "interval_s": round(span, 3),
        "heartbeat_interval_s": interval,
        "host_pid": host,
        "host_is_first_agent": host == pids[0],
        "host_cpu_s": round(host_cpu, 3),
        "host_cpu_per_s": round(host_cpu / span, 4),
        "host_cpu_per_heartbeat_interval": round(host_cpu / span * interval, 4),
        "other_agent_cpu_per_s_median": round(statistics.median(others) / span, 4)
        if others
        else None,
        "all_agents_cpu_per_s": round((host_cpu + sum(others)) / span, 4),
        "vmhwm_mb": {
            "median": round(statistics.median(rss_mb), 1),
            "min": round(min(rss_mb), 1),
            "max": round(max(rss_mb), 1),
            "host": round((hwm[host] or 0) / 1024, 1),
        },
    }
    if before_count and after_count and after_count[1] > before_count[1]:
        took = after_count[1] - before_count[1]
        kinds = {
            k: after_count[0][k] - before_count[0].get(k, 0)
            for k in sorted(after_count[0])
            if after_count[0][k] != before_count[0].get(k, 0)
        }
        per_s = sum(kinds.values()) / took
        result["store_requests"] = {
            "counted_over_s": round(took, 3),
            "per_node_per_s_by_kind": {k: round(v / took / nodes, 2) for k, v in kinds.items()},
            "per_s": round(per_s, 1),
            "per_heartbeat_interval": round(per_s * interval, 1),
            "per_node_per_interval": round(per_s * interval / nodes, 2),
            "host_cpu_us_per_request": round(host_cpu / span / per_s * 1e6, 1) if per_s else None,
        }
    return result
