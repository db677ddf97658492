"""Preemption on a simulated 3-host network: steps lost and time to resume, torchrun
against ours.

Each run gets a fresh ``elastic.harness.cluster`` cluster (3 hosts, own addresses and
names) and one agent per host: ``--nnodes=2:3 --nproc-per-node=1 --rdzv-backend=c10d
--max-restarts=3``, the c10d store on host 0, ``last_call_timeout=1``, both launchers with
their default liveness settings and ``RES_OPTIONS="timeout:1 attempts:1"``. The same script
runs under both (``elastic.harness.multihost.PREEMPT_WORKER``): a gloo DDP job on CPU that
sleeps ``--pause`` s per step, checkpoints every ``--every`` steps (rank 0 saves atomically,
then a barrier) and also asks ``elastic.checkpoint_requested()`` every step with one
all_reduce MAX, saving on notice (always False under torchrun, which has no notice: its job
resumes from the last periodic checkpoint). When the 3-node job has completed ``--at``
steps, host 2's agent (never the store's host) gets SIGTERM. Measured, per launcher:

- steps lost: the last step any rank completed in the 3-node round minus the step the
  survivors resume from (both from the workers' own event lines);
- to next step: from the SIGTERM to the survivors' first completed step of the new 2-node
  round (the later of the two survivors; hosts share one clock);
- of which to their new workers: from the SIGTERM to the later survivor's new worker's
  first statement (before it imports torch): the launchers' share; the rest is the
  worker's own start-up (import torch, ``init_process_group``, load, one step);
- restart: whether the new round spent the restart budget (``TORCHELASTIC_RESTART_COUNT``);
- the preempted agent's exit code and time, and whether the job then finished.

``ours-warm`` is ours with ``--warm-restarts``: the survivors' new workers start in
spares made while the job ran, with torch imported (``--impls torchrun,ours,ours-warm``).
Launchers alternate run by run; medians over ``--repeat`` runs, then ratios ours/torchrun.

    python bench/preemption.py [--impls torchrun,ours] [--repeat 3] [--every 20] [--at 30]
                               [--after 20] [--pause 0.1] [--bound 90] [--json out.json]
                               [--keep DIR] [--keep-resolver] [--wait-quiet S] [--max-load 3]

``--wait-quiet S`` first waits up to S s (polling every 30 s) for a 1-min load average under
``--max-load`` with no pytest running, then runs anyway. Needs root (network namespaces);
without it, one line and exit 1. Prints a Markdown table, the ratios, then JSON (with the
commit, what the wait saw, and the 1-min load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from elastic.harness.benchmarking import (
    add_report_options,
    command_line,
    commit,
    in_scratch_dir,
    spread,
    wait_for_quiet,
    write_runs_report,
)
from elastic.harness.cluster import Cluster, cluster_available
from elastic.harness.preemption_job import last_step, preempt_job, read_events
from elastic.testing.waits import wait_until

IMPLS = {
    "torchrun": "torchrun (c10d)",
    "ours": "ours (c10d)",
    "ours-warm": "ours (c10d), --warm-restarts",
}
FORM_TIMEOUT = 120.0


def run_case(impl: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    env = {} if args.keep_resolver else {"RES_OPTIONS": "timeout:1 attempts:1"}
    with Cluster(3) as cluster:
        nodes = list(cluster.hosts)
        job = preempt_job(
            cluster,
            workdir,
            steps=args.at + args.after,
            every=args.every,
            pause=args.pause,
            nnodes="2:3",
            args=["--max-restarts=3", *(["--warm-restarts"] if impl == "ours-warm" else [])],
            launcher="ours" if impl == "ours-warm" else impl,
            env=env,
        )
        if not job.start_together(nodes, FORM_TIMEOUT):
            return {"result": "did not form", "logs": job.texts()}
        trained = lambda: last_step(read_events(job.workdir), 3) >= args.at  # noqa: E731
        if not wait_until(trained, 120, interval=0.02):
            return {"result": "did not train", "logs": job.texts()}
        victim, survivors = nodes[2], nodes[:2]
        victim_proc = job.nodes[victim.name].proc
        agents = [job.nodes[h.name].proc for h in survivors]
        at = time.time()
        os.kill(victim_proc.pid, signal.SIGTERM)
        left: list[float] = []

        def first_steps() -> dict[str, float]:
            firsts: dict[str, float] = {}
            for e in read_events(job.workdir):
                if e["event"] == "step" and e["world"] == 2 and e["t"] > at:
                    firsts.setdefault(e["host"], e["t"])
            return firsts

        def ended() -> bool:
            if not left and victim_proc.poll() is not None:
                left.append(time.time() - at)
            return all(p.poll() is not None for p in agents)

        wait_until(lambda: len(first_steps()) == len(survivors) or ended(), args.bound, 0.05)
        wait_until(ended, 60, 0.05)  # the job finishes (or fails) on the survivors
        wait_until(lambda: victim_proc.poll() is not None and ended(), 30, 0.05)
        seen = read_events(job.workdir)
        out: dict[str, Any] = {"logs": job.texts()}
        out["victim_exit"] = victim_proc.poll()
        out["victim_left_s"] = round(left[0], 2) if left else None
        out["survivor_exits"] = [p.poll() for p in agents]
        notice = sorted({e["step"] for e in seen if e["event"] == "saved" and e["why"] == "notice"})
        out["notice_save_step"] = notice
        out["before"] = last_step(seen, 3)
        firsts = first_steps()
        starts = [e for e in seen if e["event"] == "start" and e["world"] == 2 and e["t"] > at]
        if len(firsts) < len(survivors) or not starts:
            codes = out["survivor_exits"]
            out["result"] = f"never resumed ({args.bound:.0f} s; survivors exit {codes})"
            return out
        out["resumed_from"] = min(e["step"] for e in starts)
        out["steps_lost"] = out["before"] - out["resumed_from"]
        out["next_step_s"] = round(max(firsts.values()) - at, 2)
        out["restart"] = max(e["restart"] for e in starts)
        # When the survivors' new workers began (first statement, before any import): the
        # launcher's share of the time to the next step; the rest is the worker's start-up.
        began = [r["t"] for r in job.starts() if r["world"] == 2 and r["t"] > at]
        out["workers_s"] = round(max(began) - at, 2) if began else None
        try:
            final = json.loads((workdir / "ckpt" / "final.json").read_text())
        except (OSError, ValueError):
            final = {}
        out["finished"] = final.get("step") == args.at + args.after and out["survivor_exits"] == [
            0,
            0,
        ]
        out["result"] = (
            f"{out['steps_lost']} steps lost, next step {out['next_step_s']:.2f} s"
            + (f", restart {out['restart']}" if out["restart"] else ", no restart")
            + ("" if out["finished"] else ", did not finish")
        )
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--every", type=int, default=20, help="periodic checkpoint, in steps")
    parser.add_argument("--at", type=int, default=30, help="SIGTERM after this many steps")
    parser.add_argument("--after", type=int, default=20, help="steps the job runs past --at")
    parser.add_argument("--pause", type=float, default=0.1, help="s each step sleeps")
    parser.add_argument("--bound", type=float, default=90.0, help="s to wait for a resume")
    parser.add_argument("--keep", help="keep every run's logs under this directory")
    parser.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to S s for load")
    parser.add_argument("--max-load", type=float, default=3.0)
    add_report_options(parser)
    args = parser.parse_args()
    ok, why = cluster_available()
    if not ok:
        sys.exit(f"bench/preemption.py: {why}")
    impls = [i for i in args.impls.split(",") if i]
    for impl in impls:
        if impl not in IMPLS:
            sys.exit(f"bench/preemption.py: --impls: {impl!r} is not one of {', '.join(IMPLS)}")
    quiet = wait_for_quiet(args.max_load, args.wait_quiet) if args.wait_quiet else None
    load_before = os.getloadavg()[0]
    results: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        for impl in impls if rep % 2 == 0 else impls[::-1]:
            case, took = in_scratch_dir(
                f"preemption-{impl}-", args.keep, lambda w, i=impl: run_case(i, args, w)
            )
            case.update(impl=impl, repeat=rep)
            load = os.getloadavg()[0]
            print(
                f"# {impl} #{rep}: {case['result']} ({took:.0f} s, load {load:.2f})",
                file=sys.stderr,
                flush=True,
            )
            results.append(case)
    load_after = os.getloadavg()[0]

    summary: dict[str, dict[str, Any]] = {}
    print(
        "| launcher | steps lost | SIGTERM -> survivors' next step | of which: to their "
        "new workers | restart spent | preempted agent exits | job finished |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for impl in impls:
        runs = [r for r in results if r["impl"] == impl]
        good = [r for r in runs if "steps_lost" in r]
        if len(good) < len(runs) or not good:
            print(f"| {IMPLS[impl]} | " + "; ".join(r["result"] for r in runs) + " | | | | | |")
            continue
        lost = [r["steps_lost"] for r in good]
        secs = [r["next_step_s"] for r in good]
        began = [r["workers_s"] for r in good if r["workers_s"] is not None]
        restarts = sum(1 for r in good if r["restart"])
        exits = sorted({str(r["victim_exit"]) for r in good})
        left = [r["victim_left_s"] for r in good if r["victim_left_s"] is not None]
        summary[impl] = {
            "steps_lost": statistics.median(lost),
            "next_step_s": statistics.median(secs),
            "workers_s": statistics.median(began) if began else None,
        }
        print(
            f"| {IMPLS[impl]} | {spread(lost, 'g')} | {spread(secs, '.2f')} s "
            f"| {spread(began, '.2f') + ' s' if began else '?'} "
            f"| {restarts}/{len(good)} runs | code {'/'.join(exits)} after "
            f"{spread(left, '.2f') if left else '?'} s "
            f"| {sum(1 for r in good if r['finished'])}/{len(good)} |"
        )
    ratios: dict[str, float | None] = {}
    if "ours" in summary and "torchrun" in summary:
        for key in ("steps_lost", "next_step_s", "workers_s"):
            ours, peer = summary["ours"][key], summary["torchrun"][key]
            ratios[key] = round(ours / peer, 2) if ours is not None and peer else None
        print(
            f"\nours / torchrun (medians): steps lost {summary['ours']['steps_lost']:g} / "
            f"{summary['torchrun']['steps_lost']:g} = {ratios['steps_lost']}, "
            f"time to next step {summary['ours']['next_step_s']:.2f} / "
            f"{summary['torchrun']['next_step_s']:.2f} s = {ratios['next_step_s']}, "
            f"to the survivors' new workers {ratios['workers_s']}"
        )
    report = {
        "command": command_line(),
        "commit": commit(),
        "quiet_wait": quiet,
        "loadavg_1m_before_after": [round(load_before, 2), round(load_after, 2)],
        "summary": summary,
        "ratios_ours_over_torchrun": ratios,
    }
    write_runs_report(report, results, args.json_path)


if __name__ == "__main__":
    main()
