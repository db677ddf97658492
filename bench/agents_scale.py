"""N agent processes on this machine with the c10d rendezvous, ``elastic run`` against
``torchrun``: start-up at scale, the store host's CPU while they heartbeat, agent RSS.

Every agent is a separate process, ``<launcher> --nnodes=N --nproc-per-node=1
--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:<free port> --rdzv-id=<unique>
--max-restarts=0 workers/probe.py OUT_DIR MODE``; ours is ``python -m elastic run``,
torchrun is ``python -m torch.distributed.run``. The worker (no torch) writes
``time.time()`` as its first statement. The agent that binds the endpoint first hosts the
store (both launchers); the bench finds it as the process listening on the port.

Scale runs (``--nodes``, worker mode ``start``: it exits at once; ``--worker sleep:S``:
it runs S s, so a node that fenced itself would restart it and fail the run), from just
before the first agent's ``Popen``:

  workers   until the last of the N workers has started (its first statement)
  wall      until every agent has exited (every exit code must be 0)
  cpu       per agent: user+system CPU of the agent and its worker (``wait4``'s rusage),
            median over the N agents, and the sum over all N (``cpu_total``; divided by
            the cores it is the floor of ``wall`` on this machine)

The launchers alternate (who goes first alternates each repetition) after a discarded
warm-up of each at the smallest N. Each run is capped (``--timeout``); a run is also cut
short when ``MemAvailable`` falls below ``--min-available-mb``, so a launcher that does not
fit the machine's memory fails instead of waking the OOM killer. After a failed run a
launcher is not tried at larger N (``--keep-going [ours,torchrun]`` to try anyway).
Every agent's process group, every descendant and every worker (by the pid it records) is
SIGKILLed after each run, failed or not.

Heartbeat runs (``--heartbeat-seconds S`` at ``--heartbeat-nodes``, workers ``sleep``):
once all N workers run and ``--settle`` s have passed, the store host's CPU time
(``/proc/<pid>/stat``) is read over S seconds, as is every other agent's. For ours the
store's requests are counted too: the agents run through a ``-c`` wrapper that counts
``TCPStoreServer._handle`` calls by kind (``--no-count-requests``: bare). At the end of
the interval every agent's ``VmHWM`` (peak RSS so far: rendezvous, spawn and S s of
heartbeats, not the exit) is read. Heartbeat intervals are each launcher's default: ours
``heartbeat_interval`` 1 s, torchrun's ``keep_alive_interval`` 5 s.

Bytecode: this environment sets ``PYTHONDONTWRITEBYTECODE=1`` and the project is an
editable install without ``__pycache__``, so every agent of ours would compile its ~100
modules from source (~0.18 s CPU each) while torch's are cached in site-packages, as on any
real install. ``--bytecode cached`` (the default) gives every interpreter a
``PYTHONPYCACHEPREFIX`` (``--pycache-prefix``), filled by a priming 1-node job of each
launcher before anything is timed; ``--bytecode env`` runs as the environment says.
``--ours-args``/``--torchrun-args`` add launcher options (e.g.
``--rdzv-conf=heartbeat_timeout=30``).

``--startup`` also measures one agent's start-up alone: CPU time of ``<launcher> --help``
(median of 5) and the largest cumulative imports of ``python -X importtime``.

    python bench/agents_scale.py --nodes 16,64,128,256 --repeat 3
    python bench/agents_scale.py --nodes 16,32,64,96,128 --impls torchrun --repeat 1 \\
        --timeout 300                                     # the largest N torchrun completes
    python bench/agents_scale.py --nodes 256 --impls ours --repeat 0 \\
        --heartbeat-seconds 20 --heartbeat-nodes 64,128,256
    python bench/agents_scale.py --nodes 256 --impls ours --repeat 1 --warmup 0 \\
        --worker sleep:25 --timeout 400         # long-running workers: formed, then finished
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from elastic.harness.benchmarking import (
    add_report_options,
    bench_env,
    command_line,
    sample_stats,
    wait_for_quiet,
    write_report,
)
from elastic.harness.processes import (
    kill_tree,
    launcher_cmd,
    mem_available_mb,
    proc_cpu_seconds,
    proc_status_kb,
    raise_nofile,
    sigkill_group,
)
from elastic.harness.records import read_records
from elastic.testing.ports import free_port, listening_pid

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "probe.py"
METRICS = ("workers", "wall", "cpu_median", "cpu_total")
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
    ) -> None:
        self.impl, self.nodes = impl, nodes
        self.dir = Path(tempfile.mkdtemp(prefix=f"{impl}-{nodes}-", dir=work))
        self.port = free_port()
        launcher = launcher_cmd(impl)
        if count_requests and impl == "ours":
            launcher = [sys.executable, "-c", COUNTING_AGENT, "run"]
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
    job = Job(impl, nodes, args.worker, env, work, extra=args.extra[impl])
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
        impl, nodes, f"sleep:{hold:g}", env, work, count_requests=count, extra=args.extra[impl]
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


def prime(env: dict[str, str], impls: list[str], work: Path) -> dict[str, float]:
    """One 1-node c10d job of each launcher, so every module an agent or a worker imports
    has its bytecode in the cache before anything is timed. Returns each one's wall time."""
    took = {}
    for impl in impls:
        job = Job(impl, 1, "start", env, work)
        try:
            job.start()
            job.wait(lambda job=job: job.alive() == 0, job.started + 300, 0.0)
        finally:
            job.kill()
        took[impl] = round(time.time() - job.started, 2)
    return took


def bytecode_env(env: dict[str, str], mode: str, prefix: str) -> dict[str, str]:
    """``cached``: bytecode is written once to (and read from) ``prefix`` for every module,
    the project's included, whatever ``PYTHONDONTWRITEBYTECODE`` says; ``env``: as the
    environment has it."""
    if mode == "env":
        return env
    env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = prefix
    return env


def startup_profile(env: dict[str, str], impls: list[str]) -> dict[str, Any]:
    """One agent's start-up alone: ``--help``'s CPU, and the heaviest imports."""
    out: dict[str, Any] = {}
    for impl in ["python", *impls]:
        cmd = [sys.executable, "-c", "pass"] if impl == "python" else [*launcher_cmd(impl)]
        if impl != "python":
            cmd.append("--help")
        cpus, walls = [], []
        for _ in range(5):
            t = time.time()
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
            )
            _, _, usage = os.wait4(proc.pid, 0)
            walls.append(time.time() - t)
            cpus.append(usage.ru_utime + usage.ru_stime)
        entry: dict[str, Any] = {
            "command": " ".join(cmd),
            "cpu_s": sample_stats(cpus, 3),
            "wall_s": sample_stats(walls, 3),
        }
        if impl != "python":
            proc = subprocess.run(
                [sys.executable, "-X", "importtime", *cmd[1:]],
                capture_output=True,
                text=True,
                env=env,
            )
            rows = []
            for line in proc.stderr.splitlines():
                m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
                if m:
                    rows.append((int(m[2]), len(m[3]) // 2, m[4]))
            total = sum(c for c, depth, _ in rows if depth == 0)
            top = sorted((r for r in rows if r[1] <= 1), reverse=True)[:12]
            entry["import_total_ms"] = round(total / 1000, 1)
            entry["imports_ms"] = {name: round(c / 1000, 1) for c, _, name in top}
        out[impl] = entry
    return out


def render(scale: dict[str, Any], impls: list[str]) -> str:
    head = f"{'N':>5} {'metric':<11}" + "".join(f"{i + ' median [min-max]':>30}" for i in impls)
    lines = [head, "-" * len(head)]
    for nodes, entry in scale.items():
        for metric in METRICS:
            cells = []
            for impl in impls:
                s = entry[impl][metric]
                cells.append(
                    (
                        "-"
                        if s["median"] is None
                        else f"{s['median']:.2f} [{s['min']:.2f}-"
                        f"{s['max']:.2f}] n={len(s['samples'])}"
                    ).rjust(30)
                )
            lines.append(f"{nodes:>5} {metric:<11}" + "".join(cells))
        fails = ", ".join(f"{i} {entry[i]['failed']}" for i in impls)
        lines.append(f"{nodes:>5} {'failed runs':<11} {fails}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="16,64,128,256", help="comma list of N (scale runs)")
    parser.add_argument("--repeat", type=int, default=3, help="scale runs per N and launcher")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="cap per run, seconds")
    parser.add_argument(
        "--worker",
        default="start",
        help="scale runs' worker mode: start (exit at once) or sleep:SECS (long-running: "
        "the round must stay formed, nobody fenced, until they finish)",
    )
    parser.add_argument("--impls", default="ours,torchrun", help="comma list: ours,torchrun")
    parser.add_argument(
        "--keep-going",
        nargs="?",
        const="ours,torchrun",
        default="",
        help="comma list of launchers tried at larger N after they failed (bare: both)",
    )
    parser.add_argument(
        "--min-available-mb",
        dest="min_mb",
        type=float,
        default=3072.0,
        help="cut a run short when MemAvailable falls below this",
    )
    parser.add_argument("--heartbeat-seconds", type=float, default=0.0)
    parser.add_argument("--heartbeat-nodes", default="64,128,256")
    parser.add_argument("--heartbeat-impls", default="ours")
    parser.add_argument("--settle", type=float, default=3.0, help="s after all workers run")
    parser.add_argument("--no-count-requests", dest="count_requests", action="store_false")
    parser.add_argument("--startup", action="store_true", help="profile one agent's start-up")
    parser.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to S s for load")
    parser.add_argument("--max-load", type=float, default=3.0)
    parser.add_argument("--nofile", type=int, default=65536, help="raise RLIMIT_NOFILE to this")
    parser.add_argument("--keep-dirs", action="store_true", help="keep agent logs and stamps")
    parser.add_argument("--ours-args", default="", help="extra launcher options for ours")
    parser.add_argument("--torchrun-args", default="", help="extra options for torchrun")
    parser.add_argument(
        "--bytecode",
        choices=("cached", "env"),
        default="cached",
        help="cached: every interpreter reads bytecode from --pycache-prefix, written by a "
        "priming run first; env: as the environment says (PYTHONDONTWRITEBYTECODE=1 makes "
        "every agent compile the project's modules from source)",
    )
    parser.add_argument("--pycache-prefix", default="/tmp/elastic-bench-pycache")
    add_report_options(parser)
    args = parser.parse_args(argv)
    args.extra = {"ours": shlex.split(args.ours_args), "torchrun": shlex.split(args.torchrun_args)}
    impls = [i for i in args.impls.split(",") if i]
    node_list = [int(n) for n in args.nodes.split(",") if n]
    env = bytecode_env(bench_env(args), args.bytecode, args.pycache_prefix)
    nofile = raise_nofile(args.nofile)
    quiet = wait_for_quiet(args.max_load, args.wait_quiet) if args.wait_quiet else None
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="elastic-agents-scale-"))
    failed_any = False
    report: dict[str, Any] = {
        "command": command_line(),
        "launchers": {i: [*launcher_cmd(i), *args.extra[i]] for i in impls},
        "quiet_wait": quiet,
    }

    def note(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    report["bytecode"] = {
        "mode": args.bytecode,
        "PYTHONPYCACHEPREFIX": env.get("PYTHONPYCACHEPREFIX"),
        "PYTHONDONTWRITEBYTECODE": env.get("PYTHONDONTWRITEBYTECODE"),
    }
    beat_impls = [i for i in args.heartbeat_impls.split(",") if i]
    primed = [*impls, *(i for i in beat_impls if i not in impls and args.heartbeat_seconds)]
    report["prime_s"] = prime(env, primed, work)
    note(f"primed: {report['prime_s']}")
    if args.startup:
        report["startup"] = startup_profile(env, impls)
        for impl, entry in report["startup"].items():
            note(f"startup {impl}: cpu {entry['cpu_s']['median']:.3f}s")

    samples: dict[int, dict[str, dict[str, list[float]]]] = {
        n: {i: {m: [] for m in METRICS} for i in impls} for n in node_list
    }
    failures: dict[int, dict[str, list[dict[str, Any]]]] = {
        n: {i: [] for i in impls} for n in node_list
    }
    given_up: set[str] = set()
    if node_list and args.repeat:
        for _ in range(args.warmup):
            for impl in impls:
                r = scale_run(impl, min(node_list), env, work, args)
                note(f"warmup {impl} N={min(node_list)}: {'ok' if r['ok'] else r['reason']}")
        for nodes in node_list:
            for rep in range(args.repeat):
                for impl in impls if rep % 2 == 0 else impls[::-1]:
                    if impl in given_up:
                        continue
                    r = scale_run(impl, nodes, env, work, args)
                    if r["ok"]:
                        for metric in METRICS:
                            samples[nodes][impl][metric].append(r[metric])
                        text = " ".join(f"{m} {r[m]:.2f}s" for m in METRICS)
                    else:
                        failed_any = True
                        failures[nodes][impl].append({"repeat": rep, **r})
                        text = f"FAILED ({r['reason']}, dir {r['dir']})"
                        if impl not in args.keep_going.split(","):
                            given_up.add(impl)
                    note(f"{impl} N={nodes} #{rep}: {text} load {os.getloadavg()[0]:.2f}")
        scale: dict[int, Any] = {}
        for nodes in node_list:
            scale[nodes] = {
                impl: {
                    **{m: sample_stats(samples[nodes][impl][m], 3) for m in METRICS},
                    "failed": len(failures[nodes][impl]),
                }
                for impl in impls
            }
        report["scale"] = scale
        report["scale_failures"] = {
            n: {i: f for i, f in failures[n].items() if f} for n in node_list
        }
        largest = {
            impl: max((n for n in node_list if samples[n][impl]["wall"]), default=None)
            for impl in impls
        }
        report["largest_n_completed"] = largest
        print(render(scale, impls))
        print(f"largest N completed: {largest}")

    if args.heartbeat_seconds > 0:
        beats: dict[str, dict[int, Any]] = {}
        for impl in beat_impls:
            beats[impl] = {}
            for nodes in [int(n) for n in args.heartbeat_nodes.split(",") if n]:
                r = heartbeat_run(impl, nodes, env, work, args)
                beats[impl][nodes] = r
                if not r["ok"]:
                    failed_any = True
                    note(f"heartbeat {impl} N={nodes}: FAILED ({r['reason']}, dir {r['dir']})")
                    continue
                req = r.get("store_requests", {})
                note(
                    f"heartbeat {impl} N={nodes}: host cpu {r['host_cpu_per_s']:.4f} s/s, "
                    f"{req.get('per_s', '-')} req/s, VmHWM median {r['vmhwm_mb']['median']} MB "
                    f"max {r['vmhwm_mb']['max']} MB host {r['vmhwm_mb']['host']} MB"
                )
        report["heartbeat"] = beats

    load_after = os.getloadavg()
    report.update(
        nodes=node_list,
        repeat=args.repeat,
        warmup=args.warmup,
        timeout=args.timeout,
        res_options=env.get("RES_OPTIONS"),
        machine={
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "rlimit_nofile": list(nofile),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
    )
    print(
        f"load average before {report['machine']['loadavg_before']}, after "
        f"{report['machine']['loadavg_after']}"
    )
    write_report(report, args.json_path)
    if failed_any or args.keep_dirs:
        print(f"agent logs kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
