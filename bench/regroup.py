"""In-place regroup on a simulated 3-host network: a State API job through a membership
change, regrouped in place (ours), restarted (ours with ``regroup_in_place=False``: the
path every script took before) and under torchrun.

Each run gets a fresh ``elastic.harness.cluster`` cluster (3 hosts) and one agent per
host: ``--nnodes=2:3 --nproc-per-node=1 --rdzv-backend=c10d --max-restarts=3``, the c10d
store on host 0, ``last_call_timeout=1``, default liveness settings and
``RES_OPTIONS="timeout:1 attempts:1"``. The script is
``elastic.harness.regroup_job.REGROUP_WORKER``: ``elastic.train`` on gloo, no
checkpointer, ``--pause`` s per step, an integer state that ends bit-identical to an
unbroken run's whatever the membership did. Once the job has done ``--at`` steps:

- ``sigterm``: host 2's agent gets SIGTERM (a preemption notice);
- ``sigkill``: host 2 is SIGKILLed whole (agent and workers);
- ``join``: (a 2-host job) host 2's agent starts.

Measured: from the fault (the agent's start, for ``join``) to the survivors' first step
in the new world (the later survivor's; hosts share one clock); for ``join`` also the
survivors' pause (their last step in the old world to their first in the new); steps
redone; whether the survivors kept their worker processes; restarts spent; whether the
final state equals the unbroken run's. Medians [min-max] over ``--repeat`` runs,
launchers alternating, then ratios against ours-in-place.

    python bench/regroup.py [--cases sigterm,sigkill,join] [--impls ours,restart,torchrun]
                            [--repeat 3] [--at 10] [--steps 120] [--pause 0.1] [--json out.json]
                            [--keep DIR] [--keep-resolver] [--wait-quiet S] [--max-load 3]

Needs root (network namespaces); without it, one line and exit 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
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
from elastic.harness.preemption_job import read_events
from elastic.harness.regroup_job import REGROUP_WORKER, regroup_job
from elastic.testing.waits import wait_until

IMPLS = {"ours": "ours, in place", "restart": "ours, restart", "torchrun": "torchrun (c10d)"}
CASES = ("sigterm", "sigkill", "join")
FORM_TIMEOUT = 120.0


def reference(steps: int, workdir: Path) -> int:
    script = workdir / "reference.py"
    script.write_text(REGROUP_WORKER)
    out = subprocess.run(
        [sys.executable, str(script), "--reference", str(steps)], capture_output=True, check=True
    )
    return int(out.stdout)


def run_case(case: str, impl: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    env = {} if args.keep_resolver else {"RES_OPTIONS": "timeout:1 attempts:1"}
    with Cluster(3) as cluster:
        nodes = list(cluster.hosts)
        first = nodes if case != "join" else nodes[:2]
        old, new = (3, 2) if case != "join" else (2, 3)
        survivors = nodes[:2]
        job = regroup_job(
            cluster,
            workdir,
            steps=args.steps,
            pause=args.pause,
            nnodes="2:3",
            args=["--max-restarts=3"],
            launcher="ours" if impl != "torchrun" else "torchrun",
            in_place=impl == "ours",
            env=env,
        )
        if not job.start_together(first, FORM_TIMEOUT):
            return {"result": "did not form", "logs": job.texts()}

        def steps_in(world: int) -> list[dict[str, Any]]:
            seen = read_events(job.workdir)
            return [e for e in seen if e["event"] == "step" and e["world"] == world]

        if not wait_until(lambda: any(e["step"] >= args.at for e in steps_in(old)), 120, 0.02):
            return {"result": "did not train", "logs": job.texts()}
        at = time.time()
        if case == "sigterm":
            os.kill(job.nodes[nodes[2].name].proc.pid, signal.SIGTERM)
        elif case == "sigkill":
            nodes[2].kill()
        else:
            job.start(nodes[2])
        agents = [job.nodes[h.name].proc for h in survivors]

        def firsts() -> dict[str, float]:
            out: dict[str, float] = {}
            for e in steps_in(new):
                if e["t"] > at:
                    out.setdefault(e["host"], e["t"])
            return out

        names = {h.name for h in survivors}
        wait_until(lambda: names <= set(firsts()), args.bound, 0.05)
        wait_until(lambda: all(p.poll() is not None for p in agents), 120, 0.1)
        seen = read_events(job.workdir)
        out: dict[str, Any] = {"logs": job.texts(), "exits": [p.poll() for p in agents]}
        got = firsts()
        if not names <= set(got):
            out["result"] = f"no step in the new world within {args.bound:.0f} s"
            return out
        mine = [e for e in seen if e["event"] == "step" and e["host"] in names]
        before = [e for e in mine if e["world"] == old]
        after = [e for e in mine if e["world"] == new and e["t"] > at]
        out["first_step_s"] = round(max(got.values()) - at, 2)
        out["pause_s"] = round(min(e["t"] for e in after) - max(e["t"] for e in before), 2)
        out["redone"] = max(e["step"] for e in before) - min(e["step"] for e in after) + 1
        out["kept"] = {(e["host"], e["pid"]) for e in before} == {
            (e["host"], e["pid"]) for e in after
        }
        out["restart"] = max(e["restart"] for e in after)
        done = {e["value"] for e in seen if e["event"] == "done"}
        out["exact"] = done == {args.expected}
        out["result"] = (
            f"first step {out['first_step_s']:.2f} s, {out['redone']} redone, "
            f"{'same' if out['kept'] else 'new'} processes, restart {out['restart']}"
            f"{'' if out['exact'] else ', NOT exact'}"
        )
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--at", type=int, default=10, help="the fault after this many steps")
    parser.add_argument("--steps", type=int, default=120, help="the job's length")
    parser.add_argument("--pause", type=float, default=0.1, help="s each step sleeps")
    parser.add_argument("--bound", type=float, default=90.0, help="s to wait for a new world")
    parser.add_argument("--keep", help="keep every run's logs under this directory")
    parser.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to S s for load")
    parser.add_argument("--max-load", type=float, default=3.0)
    add_report_options(parser)
    args = parser.parse_args()
    ok, why = cluster_available()
    if not ok:
        sys.exit(f"bench/regroup.py: {why}")
    impls = [i for i in args.impls.split(",") if i]
    cases = [c for c in args.cases.split(",") if c]
    for name, given, known in (("--impls", impls, IMPLS), ("--cases", cases, CASES)):
        for item in given:
            if item not in known:
                sys.exit(f"bench/regroup.py: {name}: {item!r} is not one of {', '.join(known)}")
    quiet = wait_for_quiet(args.max_load, args.wait_quiet) if args.wait_quiet else None
    args.expected = in_scratch_dir("regroup-ref-", None, lambda w: reference(args.steps, w))[0]
    load_before = os.getloadavg()[0]
    results: list[dict[str, Any]] = []
    for case in cases:
        for rep in range(args.repeat):
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                run, took = in_scratch_dir(
                    f"regroup-{case}-{impl}-",
                    args.keep,
                    lambda w, c=case, i=impl: run_case(c, i, args, w),
                )
                run.update(case=case, impl=impl, repeat=rep)
                load = os.getloadavg()[0]
                print(
                    f"# {case} {impl} #{rep}: {run['result']} ({took:.0f} s, load {load:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
                results.append(run)
    load_after = os.getloadavg()[0]
    summary: dict[str, dict[str, Any]] = {}
    print(
        "| case | launcher | fault -> survivors' first step in the new world | survivors' "
        "pause | steps redone | same processes | restarts | final state exact |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in cases:
        for impl in impls:
            runs = [r for r in results if r["case"] == case and r["impl"] == impl]
            good = [r for r in runs if "first_step_s" in r]
            if not good or len(good) < len(runs):
                print(f"| {case} | {IMPLS[impl]} | " + "; ".join(r["result"] for r in runs) + " |")
                continue
            first = [r["first_step_s"] for r in good]
            pause = [r["pause_s"] for r in good]
            redone = [r["redone"] for r in good]
            summary[f"{case}/{impl}"] = {
                "first_step_s": statistics.median(first),
                "pause_s": statistics.median(pause),
                "redone": statistics.median(redone),
            }
            print(
                f"| {case} | {IMPLS[impl]} | {spread(first, '.2f')} s | {spread(pause, '.2f')} s "
                f"| {spread(redone, 'g')} | {sum(r['kept'] for r in good)}/{len(good)} "
                f"| {sum(1 for r in good if r['restart'])}/{len(good)} "
                f"| {sum(r['exact'] for r in good)}/{len(good)} |"
            )
    ratios = {}
    for key, row in summary.items():
        case, impl = key.split("/")
        ours = summary.get(f"{case}/ours")
        if impl != "ours" and ours and row["first_step_s"]:
            ratios[key] = round(ours["first_step_s"] / row["first_step_s"], 2)
    if ratios:
        print("\nours in place / other (median time to the first step in the new world):")
        for key, ratio in ratios.items():
            print(f"  {key}: {ratio}")
    report = {
        "command": command_line(),
        "commit": commit(),
        "quiet_wait": quiet,
        "loadavg_1m_before_after": [round(load_before, 2), round(load_after, 2)],
        "summary": summary,
        "ratios_ours_in_place_over": ratios,
    }
    write_runs_report(report, results, args.json_path)


if __name__ == "__main__":
    main()
