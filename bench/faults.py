"""Faults on a simulated 3-host network: how long until the survivors train again.

For each way a node can leave (its agent gets SIGTERM, the whole node is SIGKILLed once
the job trains or as soon as its round's workers started, its cable is cut; the same for
node 0, which hosts the c10d store; two of four nodes SIGTERMed 0.5 s apart) and each
launcher/backend (torchrun 2.13 with c10d; ours with c10d, and with etcd-v3, etcd-v2 and
etcd on a fourth host), a fresh ``elastic.harness.cluster``
cluster runs a ``--nnodes=2:3 --nproc-per-node=1 --max-restarts=3`` job, one agent per host, started
together. Workers (``elastic.harness.multihost.WORKER`` with gloo) write a start record
before importing anything, then all-reduce every 0.1 s (noting each finished collective),
so a lost peer is seen the way a real job sees it. Once the 3-node job runs, node 2 (never
the c10d store's host) gets the fault; the cell is the time from the fault to the last
survivor's worker starting in a new 2-node round, on the hosts' shared clock, with
"(restart N)" when that cost restarts from the budget. Otherwise, after ``--bound`` s:
"never: job failed" (the survivors' agents exited), "hung" (their workers stopped
finishing collectives), or "never" (they train on in the old world). For a cable cut the
cell also says how long before the survivors' first new worker started the cut-off
node's workers had exited (process exit, polled every 10 ms: "gone N s before"; a
negative N is two worlds at once).

The c10d store's own faults (``store-twice``, ``store-twice-fast``, ``store-regroup``,
``store-replace``; ``FAULTS`` says what each does) run on c10d only (ours and torchrun),
on 4 hosts (3 for ``store-replace``); their cell gives the time from each preemption (or
from the replacement's start) to the nodes left training together, "a / b s".

Both launchers run with their default liveness settings (ours: heartbeat 1 s, timeout
5 s) and ``last_call_timeout=1``, and with ``RES_OPTIONS="timeout:1 attempts:1"``.

    python bench/faults.py [--faults sigterm,sigkill,sigkill-early,cut,store-sigterm,
                                     store-sigkill,two-sigterm,term-kill,store-twice,...]
                           [--impls torchrun,c10d,etcd-v3,etcd-v2,etcd] [--bound 45]
                           [--repeat 1] [--json out.json] [--keep DIR]

Needs root (network namespaces); prints a Markdown table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from elastic.harness.benchmarking import in_scratch_dir
from elastic.harness.cluster import Cluster, Host, cluster_available
from elastic.harness.multihost import C10D_PORT, ExitWatch, FaultJob, serve_rendezvous
from elastic.testing.waits import wait_until

IMPLS = {  # column -> (launcher, backend)
    "torchrun": ("torchrun", "c10d"),
    "c10d": ("ours", "c10d"),
    "etcd-v3": ("ours", "etcd-v3"),
    "etcd-v2": ("ours", "etcd-v2"),
    "etcd": ("ours", "etcd"),
}
HEADERS = {"torchrun": "torchrun (c10d)", **{k: f"ours {k}" for k in IMPLS if k != "torchrun"}}
FAULTS = {
    "sigterm": "SIGTERM to its agent",
    "sigkill": "SIGKILL (node lost)",
    "sigkill-early": "SIGKILL (node lost) as soon as the round's workers started",
    "cut": "cable cut",
    "store-sigterm": "the c10d store's host preempted (SIGTERM to node 0's agent)",
    "store-sigkill": "the c10d store's host crashed (node 0 SIGKILLed)",
    "two-sigterm": "two of 4 nodes preempted 0.5 s apart",
    "term-kill": "one of 4 preempted, another crashed 0.5 s later (last call 30 s)",
    "store-twice": "the c10d store's host preempted, then the node that took the store "
    "(4 nodes; each time from that preemption)",
    "store-twice-fast": "the same, the second preemption 10 ms after the store moved",
    "store-regroup": "a member preempted, the c10d store's host 0.3 s later (4 nodes)",
    "store-replace": "the c10d store's host preempted, then an agent started again there "
    "(--nnodes=1:3, three candidate endpoints): from that start to a world of 3",
}
# The c10d store's own faults, run only where a c10d store exists (``run_store_case``).
STORE_FAULTS = {"store-twice", "store-twice-fast", "store-regroup", "store-replace"}
# Faults whose point is what the last call costs: run at the default (30 s), not 1 s.
DEFAULT_LAST_CALL = {"term-kill"}
FORM_TIMEOUT = 120.0


def run_case(impl: str, fault: str, bound: float, workdir: Path) -> dict[str, Any]:
    launcher, backend = IMPLS[impl]
    if fault in STORE_FAULTS:
        if backend != "c10d":
            return {"result": "-"}
        return run_store_case(launcher, fault, bound, workdir)
    size = 4 if fault in ("two-sigterm", "term-kill") else 3
    with Cluster(size if backend == "c10d" else size + 1) as cluster:
        nodes, endpoint = serve_rendezvous(cluster, backend, workdir, size)
        job = FaultJob(
            cluster,
            workdir / "job",
            backend,
            endpoint,
            launcher=launcher,
            nnodes=f"2:{size}",
            conf={"last_call_timeout": 30 if fault in DEFAULT_LAST_CALL else 1},
            args=["--max-restarts=3"],
            gloo=True,
            env={"RES_OPTIONS": "timeout:1 attempts:1"},
        )
        if not job.start_together(nodes, FORM_TIMEOUT):
            return {"result": "did not form", "logs": job.texts()}
        if fault != "sigkill-early":  # that one lands in the round's first second
            # Let gloo connect and a few collectives finish before the fault.
            wait_until(lambda: all(job.progressed_at(r) for r in map(job.latest, nodes) if r), 60)
            time.sleep(2.0)
        victims = {
            "store-sigterm": [0],
            "store-sigkill": [0],
            "two-sigterm": [2, 3],
            "term-kill": [2, 3],
        }
        gone = [nodes[i] for i in victims.get(fault, [2])]
        survivors = [h for h in nodes if h not in gone]
        exits = None
        if fault == "cut":  # the cut-off node's worker processes: when they exit
            exits = ExitWatch([r["pid"] for r in job.starts() if r["host"] == gone[0].name])
        at = time.time()
        if fault in ("sigterm", "store-sigterm", "two-sigterm"):
            for i, victim in enumerate(gone):
                if i:
                    time.sleep(0.5)
                os.kill(job.nodes[victim.name].proc.pid, signal.SIGTERM)
        elif fault in ("sigkill", "sigkill-early", "store-sigkill"):
            gone[0].kill()
        elif fault == "term-kill":  # the crash lands while the survivors regroup
            os.kill(job.nodes[gone[0].name].proc.pid, signal.SIGTERM)
            time.sleep(0.5)
            gone[1].kill()
        else:
            cluster.cut(gone[0])
        agents = [job.nodes[h.name].proc for h in survivors]

        def ended() -> bool:
            return all(p.poll() is not None for p in agents)

        regrouped = wait_until(
            lambda: job.running_together(survivors, at) or ended(), bound, interval=0.1
        )
        out: dict[str, Any] = {"impl": impl, "fault": fault}
        if regrouped and job.running_together(survivors, at):
            out["seconds"] = round(job.regroup_time(survivors, at), 2)
            out["restart"] = max(r["restart"] for r in map(job.latest, survivors) if r)
            out["result"] = f"{out['seconds']:.2f} s" + (
                f" (restart {out['restart']})" if out["restart"] else ""
            )
            if exits is not None:
                wait_until(lambda: exits.all_exited() is not None, 15, interval=0.1)
                exited = exits.all_exited()
                names = {h.name for h in survivors}
                new = min(r["t"] for r in job.starts() if r["host"] in names and r["t"] > at)
                if exited is None:
                    out["result"] += "; cut-off workers still running"
                else:
                    out["fence_gap"] = round(new - exited, 2)
                    out["result"] += f"; gone {out['fence_gap']:.2f} s before"
        elif ended():
            codes = [p.returncode for p in agents]
            out["result"] = f"never: job failed after {time.time() - at:.0f} s (exit {codes})"
        else:
            last = [job.progressed_at(r) for r in map(job.latest, survivors) if r]
            stalled = not last or any(t is None or time.time() - t > 10 for t in last)
            out["result"] = f"hung ({bound:.0f} s)" if stalled else f"never ({bound:.0f} s)"
        if exits is not None:
            exits.stop()
        out["logs"] = job.texts()
        return out


def run_store_case(launcher: str, fault: str, bound: float, workdir: Path) -> dict[str, Any]:
    """``STORE_FAULTS``: seconds from each preemption (or the replacement's start) to the
    nodes left training together, "never ..." when they did not within ``bound``."""
    size = 3 if fault == "store-replace" else 4
    with Cluster(size) as cluster:
        nodes = list(cluster.hosts)
        # torchrun takes one endpoint: its replacement meets a new store there.
        several = fault == "store-replace" and launcher == "ours"
        endpoints = nodes if several else nodes[:1]
        job = FaultJob(
            cluster,
            workdir / "job",
            "c10d",
            ",".join(f"{h.name}:{C10D_PORT}" for h in endpoints),
            launcher=launcher,
            nnodes="1:3" if fault == "store-replace" else f"2:{size}",
            conf={"last_call_timeout": 1},
            args=["--max-restarts=3"],
            gloo=True,
            env={"RES_OPTIONS": "timeout:1 attempts:1"},
        )
        if not job.start_together(nodes, FORM_TIMEOUT):
            return {"result": "did not form", "logs": job.texts()}
        wait_until(lambda: all(job.progressed_at(r) for r in map(job.latest, nodes) if r), 60)
        time.sleep(2.0)
        times: list[float] = []

        def preempt(host: Host) -> float:
            os.kill(job.nodes[host.name].proc.pid, signal.SIGTERM)
            return time.time()

        def train(hosts: list[Host], since: float) -> bool:
            agents = [job.nodes[h.name].proc for h in hosts]
            wait_until(
                lambda: (
                    job.running_together(hosts, since) or any(p.poll() is not None for p in agents)
                ),
                bound,
                interval=0.1,
            )
            if not job.running_together(hosts, since):
                return False
            times.append(round(job.regroup_time(hosts, since), 2))
            return True

        rest = nodes[1:]  # whoever is left training at the end
        if fault == "store-regroup":
            at = preempt(nodes[3])
            time.sleep(0.3)
            preempt(nodes[0])
            rest = nodes[1:3]
            ok = train(rest, at)
        else:
            at = preempt(nodes[0])
            fast = fault == "store-twice-fast"
            if fast:  # the second preemption as soon as the store moved
                ok = wait_until(lambda: handed_to(job, nodes[0], rest) is not None, 10, 0.01)
                time.sleep(0.01)
            else:
                ok = train(rest, at)
            second = handed_to(job, nodes[0], rest)
            if ok and fault == "store-replace":
                again = time.time()
                job.start(nodes[0])
                rest = nodes
                ok = train(rest, again)
            elif ok and second is not None:
                at2 = preempt(second)
                rest = [h for h in rest if h is not second]
                ok = train(rest, at if fast else at2)
            else:
                ok = False
        out: dict[str, Any] = {"times": times, "logs": job.texts()}
        if ok:
            out["seconds"] = times[-1]
            out["restart"] = max(r["restart"] for r in job.starts())
            out["result"] = " / ".join(f"{t:.2f} s" for t in times) + (
                f" (restart {out['restart']})" if out["restart"] else ""
            )
        else:
            codes = [job.nodes[h.name].proc.poll() for h in nodes]
            ended = any(c is not None for h, c in zip(nodes, codes, strict=True) if h in rest)
            out["result"] = (
                f"never: a survivor exited (exit codes {codes})"
                if ended
                else f"never ({bound:.0f} s)"
            )
        return out


def handed_to(job: FaultJob, left: Host, hosts: list[Host]) -> Host | None:
    """Whom ``left``'s agent said it handed the c10d store to (None: not said)."""
    found = re.search(
        r"handed the c10d rendezvous store over to (\S+?):\d+;", job.nodes[left.name].text()
    )
    return next((h for h in hosts if found and found[1] in (h.name, h.addr)), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--bound", type=float, default=45.0, help="s to wait for a regroup")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--keep", help="keep every run's logs under this directory")
    args = parser.parse_args()
    ok, why = cluster_available()
    if not ok:
        sys.exit(f"bench/faults.py: {why}")
    faults, impls = args.faults.split(","), args.impls.split(",")
    results: list[dict[str, Any]] = []
    for fault in faults:
        for rep in range(args.repeat):
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                case, took = in_scratch_dir(
                    f"faults-{impl}-{fault}-",
                    args.keep,
                    lambda w, i=impl, f=fault: run_case(i, f, args.bound, w),
                )
                case.update(impl=impl, fault=fault, repeat=rep)
                print(
                    f"# {fault} / {impl} #{rep}: {case['result']} ({took:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                results.append(case)
    print("| a node leaves by | " + " | ".join(HEADERS[i] for i in impls) + " |")
    print("| --- |" + " --- |" * len(impls))
    for fault in faults:
        cells = []
        for impl in impls:
            runs = [r for r in results if r["impl"] == impl and r["fault"] == fault]
            done = [r for r in runs if "seconds" in r]
            if len(done) == len(runs) and len(runs) > 1:
                restarts = max(r["restart"] for r in runs)
                # One column per timed step (the store's faults time each preemption).
                steps = zip(*(r.get("times", [r["seconds"]]) for r in done), strict=False)
                cell = " / ".join(
                    f"{statistics.median(t):.2f} s [{min(t):.2f}-{max(t):.2f}]" for t in steps
                )
                cell += f" (restart {restarts})" if restarts else ""
                gaps = [r["fence_gap"] for r in runs if "fence_gap" in r]
                cells.append(cell + (f"; gone >= {min(gaps):.2f} s before" if gaps else ""))
            else:
                cells.append("; ".join(r["result"] for r in runs))
        print(f"| {FAULTS[fault]} | " + " | ".join(cells) + " |")
    report = [{k: v for k, v in r.items() if k != "logs"} for r in results]
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
