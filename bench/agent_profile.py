"""Where an agent's time goes: N ``elastic run`` agents (c10d, loopback) holding a round,
each read per thread from ``/proc`` over a window, for one or more checkouts side by side.

The agents run ``bench/workers/probe.py`` in ``sleep:S`` mode (no torch) through a ``-c``
wrapper that (1) names every Python thread in ``/proc/<pid>/task/<tid>/comm`` after its
``threading`` name (``prctl(PR_SET_NAME)``), (2) counts the store requests the agent's
clients send, by kind, and (3) counts the requests every server in the agent answers (the
job's store on its host, a standby store elsewhere). Once every worker runs and
``--settle`` s have passed, ``--window`` s are read:

  cpu/s         user+system CPU of the agent per second of wall (its worker excluded)
  wakeups/s     voluntary context switches per second, all threads: how often it sleeps
                and is woken (a thread polling every 10 ms makes ~100)
  threads       tasks of the agent process; ``fds``, ``sockets``, ``listening``: its open
                descriptors, the sockets among them, its listening TCP sockets
  sent/s        store requests its clients sent per second (by kind in the JSON)
  served/s      requests its servers answered per second

``--waiting``: the job asks for 2N nodes, so the N agents wait for a round that does not
form (the first to join coordinates it); the window starts ``--settle`` s after the start.

Each figure is reported for the store's host (the agent that bound the endpoint; on
loopback usually the first to join too: the round's coordinator) and as the median over
the other agents, plus per thread name (cpu/s and wakeups/s, medians over the agents that
have it). ``--sides label=PYTHONPATH,...`` runs the same job under each checkout in turn
(a folder whose ``elastic`` entry is the checkout), alternating who goes first.

    python bench/agent_profile.py --nodes 8 --window 10
    python bench/agent_profile.py --nodes 8 --waiting --settle 5 --window 8
    python bench/agent_profile.py --nodes 8 --sides new=$PWD/..,base=/tmp/base-path
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "probe.py"

# The agent as ``python -c PROFILED_AGENT run ...``: threads named in /proc, requests
# counted (client side by the request's first byte, server side by kind), the counts
# rewritten to $PROFILE_DIR/<pid>.json every half second.
PROFILED_AGENT = """
import collections, ctypes, json, os, sys, threading, time
libc = ctypes.CDLL(None)
run = threading.Thread.run
def named_run(self):
    libc.prctl(15, self.name[:15].encode(), 0, 0, 0)
    return run(self)
threading.Thread.run = named_run
sent, served = collections.Counter(), collections.Counter()
from elastic.core.tcpstore import client, server, wire
roundtrip, handle = client.TCPStoreClient._roundtrip, server.TCPStoreServer._handle
def counted_roundtrip(self, payload, read):
    try:
        sent[wire.Query(payload[0]).name] += 1
    except ValueError:
        sent[str(payload[0])] += 1
    return roundtrip(self, payload, read)
def counted_handle(self, conn, req):
    served[req.query.name] += 1
    return handle(self, conn, req)
client.TCPStoreClient._roundtrip = counted_roundtrip
server.TCPStoreServer._handle = counted_handle
def dump(path):
    while True:
        with open(path + ".tmp", "w") as f:
            json.dump({"t": time.time(), "sent": sent, "served": served}, f)
        os.replace(path + ".tmp", path)
        time.sleep(0.5)
path = os.path.join(os.environ["PROFILE_DIR"], f"{os.getpid()}.json")
threading.Thread(target=dump, args=(path,), name="bench-dump", daemon=True).start()
sys.argv = ["elastic", *sys.argv[1:]]
from elastic.cli.main import main
main()
"""


def read_tasks(pid: int) -> dict[int, tuple[str, float, int]]:
    """tid -> (name, CPU seconds, voluntary context switches) of every thread of ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    tasks: dict[int, tuple[str, float, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return tasks
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            stat = Path(base, "stat").read_text()
            status = Path(base, "status").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        switches = next(
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith("voluntary_ctxt_switches")
        )
        tasks[int(tid)] = (name, cpu, switches)
    return tasks


def sockets(pid: int) -> tuple[int, int, int]:
    """(open fds, sockets among them, listening TCP sockets) of ``pid``."""
    inodes: set[str] = set()
    fds = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            fds += 1
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return 0, 0, 0
    listening = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        listening += sum(1 for ln in lines if ln.split()[3] == "0A" and ln.split()[9] in inodes)
    return fds, len(inodes), listening


def read_counts(folder: Path, pid: int) -> dict[str, Any]:
    try:
        return json.loads((folder / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return {"t": time.time(), "sent": {}, "served": {}}


def per_s(after: dict[str, int], before: dict[str, int], span: float) -> dict[str, float]:
    return {
        k: round((v - before.get(k, 0)) / span, 2) for k, v in after.items() if v > before.get(k, 0)
    }


def profile_job(label: str, path_root: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work))
    from elastic.harness.processes import kill_tree
    from elastic.testing.ports import free_port, listening_pid

    port = free_port()
    env = dict(os.environ, PYTHONPATH=path_root, PROFILE_DIR=str(folder))
    env["RES_OPTIONS"] = "timeout:1 attempts:1"
    cmd = [
        sys.executable,
        "-c",
        PROFILED_AGENT,
        "run",
        f"--nnodes={2 * args.nodes if args.waiting else args.nodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=profile-{uuid.uuid4().hex[:12]}",
        "--max-restarts=0",
        str(WORKER),
        str(folder),
        f"sleep:{args.hold}",
    ]
    procs = []
    started = time.time()
    for i in range(args.nodes):
        with open(folder / f"agent{i}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
    try:
        deadline = started + args.timeout
        while not args.waiting and len(list(folder.glob("start-*.json"))) < args.nodes:
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{label}: the workers did not all start ({folder})")
            time.sleep(0.2)
        formed = time.time() - started
        time.sleep(args.settle)
        pids = [p.pid for p in procs]
        host = listening_pid(port, pids)
        before = {pid: (read_tasks(pid), read_counts(folder, pid)) for pid in pids}
        t0 = time.time()
        time.sleep(args.window)
        span = time.time() - t0
        after = {pid: (read_tasks(pid), read_counts(folder, pid), sockets(pid)) for pid in pids}
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{label}: an agent exited during the window ({folder})")
    finally:
        for p in procs:
            kill_tree(p.pid)
        for p in procs:
            p.wait()
    agents = []
    for pid in pids:
        (tasks0, counts0), (tasks1, counts1, (fds, socks, listening)) = before[pid], after[pid]
        threads: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for tid, (name, cpu, switches) in tasks1.items():
            if name == "bench-dump":  # the wrapper's own
                continue
            _, cpu0, switches0 = tasks0.get(tid, (name, 0.0, 0))
            entry = threads["main" if tid == pid else name]
            entry[0] += (cpu - cpu0) / span
            entry[1] += (switches - switches0) / span
            entry[2] += 1
        agents.append(
            {
                "pid": pid,
                "host": pid == host,
                "cpu_per_s": round(sum(t[0] for t in threads.values()), 4),
                "wakeups_per_s": round(sum(t[1] for t in threads.values()), 1),
                "threads": len(tasks1),
                "fds": fds,
                "sockets": socks,
                "listening": listening,
                "sent_per_s": per_s(counts1["sent"], counts0["sent"], span),
                "served_per_s": per_s(counts1["served"], counts0["served"], span),
                "by_thread": {n: [round(c, 4), round(w, 1), k] for n, (c, w, k) in threads.items()},
            }
        )
    if not args.keep_dirs:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "label": label,
        "formed_s": round(formed, 2),
        "window_s": round(span, 2),
        "agents": agents,
    }


def threads_named(agents: list[dict[str, Any]], name: str) -> list[list[float]]:
    """[cpu/s, wakeups/s, count] of the threads called ``name``, per agent that has one."""
    return [a["by_thread"][name] for a in agents if name in a["by_thread"]]


def summary(run: dict[str, Any]) -> dict[str, Any]:
    def row(agents: list[dict[str, Any]]) -> dict[str, Any]:
        if not agents:
            return {}
        med = statistics.median
        names = sorted({n for a in agents for n in a["by_thread"]})
        return {
            "cpu_per_s": round(med(a["cpu_per_s"] for a in agents), 4),
            "wakeups_per_s": round(med(a["wakeups_per_s"] for a in agents), 1),
            "threads": med(a["threads"] for a in agents),
            "sockets": med(a["sockets"] for a in agents),
            "listening": med(a["listening"] for a in agents),
            "sent_per_s": round(med(sum(a["sent_per_s"].values()) for a in agents), 2),
            "served_per_s": round(med(sum(a["served_per_s"].values()) for a in agents), 2),
            "sent_by_kind": {
                k: round(med(a["sent_per_s"].get(k, 0.0) for a in agents), 2)
                for k in sorted({k for a in agents for k in a["sent_per_s"]})
            },
            "by_thread": {
                n: {
                    "cpu_per_s": round(med(t[0] for t in threads_named(agents, n)), 4),
                    "wakeups_per_s": round(med(t[1] for t in threads_named(agents, n)), 1),
                    "count": med(t[2] for t in threads_named(agents, n)),
                }
                for n in names
            },
        }

    return {
        "host": row([a for a in run["agents"] if a["host"]]),
        "others": row([a for a in run["agents"] if not a["host"]]),
        "all_agents_cpu_per_s": round(sum(a["cpu_per_s"] for a in run["agents"]), 3),
    }


def render(label: str, run: dict[str, Any], s: dict[str, Any]) -> str:
    lines = [
        f"{label}: workers ran after {run['formed_s']} s, window {run['window_s']} s, "
        f"all agents {s['all_agents_cpu_per_s']} CPU-s/s"
    ]
    for who in ("host", "others"):
        r = s[who]
        lines.append(
            f"  {who:<6} cpu/s {r['cpu_per_s']:.4f}  wakeups/s {r['wakeups_per_s']:6.1f}  "
            f"threads {r['threads']}  sockets {r['sockets']}  listening {r['listening']}  "
            f"sent/s {r['sent_per_s']} {r['sent_by_kind']}  served/s {r['served_per_s']}"
        )
        for name, t in r["by_thread"].items():
            lines.append(
                f"         {name:<22} x{t['count']:<3} cpu/s {t['cpu_per_s']:.4f}  "
                f"wakeups/s {t['wakeups_per_s']:6.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--hold", type=float, default=3600.0, help="workers' sleep, s")
    parser.add_argument("--settle", type=float, default=3.0, help="s after all workers run")
    parser.add_argument("--window", type=float, default=10.0, help="s read")
    parser.add_argument("--timeout", type=float, default=300.0, help="s for all to run")
    parser.add_argument("--repeat", type=int, default=1, help="runs per side")
    parser.add_argument(
        "--sides",
        default=f"new={os.environ.get('PYTHONPATH', '')}",
        help="comma list of label=PYTHONPATH (default: this PYTHONPATH)",
    )
    parser.add_argument(
        "--waiting",
        action="store_true",
        help="a job of 2N nodes: the N agents wait for the round that never forms",
    )
    parser.add_argument("--keep-dirs", action="store_true")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    sides = [tuple(s.split("=", 1)) for s in args.sides.split(",") if s]
    report: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in sides}
    with tempfile.TemporaryDirectory(prefix="agent-profile-") as tmp:
        for r in range(args.repeat):
            for label, path_root in sides if r % 2 == 0 else sides[::-1]:
                run = profile_job(label, path_root, args, Path(tmp))
                s = summary(run)
                print(render(label, run, s), flush=True)
                report[label].append({**run, "summary": s})
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
