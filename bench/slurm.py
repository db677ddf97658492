"""Under a real SLURM, torchrun against ours: one srun step, and the whole step SIGTERMed.

One SLURM for the whole bench (``elastic.harness.slurm``: munge, slurmctld and a slurmd
on each of 3 simulated hosts with their own names and addresses). Per launcher and run:

- one job: ``srun -N2 --ntasks-per-node=1 <launcher> --nproc-per-node=2 w.py``, nothing
  else on the line (what a user types first): how many jobs form (distinct
  ``MASTER_ADDR:MASTER_PORT`` among the workers), their world sizes, and srun's wall time;
- whole step SIGTERMed: the same step running ``elastic.harness.preemption_job``'s
  ``PREEMPT_WORKER`` (gloo DDP on CPU, ``--pause`` s per step, a periodic checkpoint every
  ``--every`` steps, and ``elastic.checkpoint_requested()`` every step, which is always
  False under torchrun), torchrun given what makes it one job under SLURM
  (``--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=<first host>:29400
  --rdzv-id=$SLURM_JOB_ID``); once it has completed ``--at`` steps,
  ``scancel --signal=TERM <job>.0`` (what preemption with a GraceTime, ``scancel`` and
  ``--signal=TERM@N`` before the time limit do). Measured: steps lost (the last step any
  rank completed minus the last step saved) and the time from the signal to srun's exit.

Launchers alternate run by run; medians over ``--repeat`` runs.

    python bench/slurm.py [--impls torchrun,ours] [--repeat 3] [--every 20] [--at 25]
                          [--pause 0.1] [--json out.json]

Needs root (network namespaces) and Debian's slurmctld, slurmd, slurm-client and munge;
without them, one line and exit 1. Prints a Markdown table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic.harness.benchmarking import command_line, commit, spread, write_runs_report
from elastic.harness.cluster import Cluster, cluster_available
from elastic.harness.preemption_job import PREEMPT_WORKER, read_events
from elastic.harness.slurm import SlurmCluster, slurm_available
from elastic.testing.waits import wait_until

IMPLS = ("torchrun", "ours")
WORKER = """\
import datetime, json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
record = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
with open(os.path.join(sys.argv[1], f"{os.getpid()}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


def launcher(impl: str) -> list[str]:
    if impl == "ours":
        return [sys.executable, "-m", "elastic", "run"]
    return [sys.executable, "-m", "torch.distributed.run"]


def one_job(slurm: SlurmCluster, impl: str, workdir: Path) -> dict[str, Any]:
    script, out = workdir / "w.py", workdir / "out"
    script.write_text(WORKER)
    out.mkdir()
    cmd = ["srun", "-N2", "--ntasks-per-node=1", *launcher(impl), "--nproc-per-node=2"]
    started = time.monotonic()
    done = slurm.run([*cmd, str(script), str(out)], timeout=300)
    took = time.monotonic() - started
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    jobs = {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records}
    worlds = sorted({int(r["WORLD_SIZE"]) for r in records})
    return {
        "srun_exit": done.returncode,
        "srun_s": round(took, 2),
        "jobs": len(jobs),
        "worlds": worlds,
        "result": f"{len(jobs)} job(s) of {worlds} workers in {took:.2f} s",
    }


def whole_step(slurm: SlurmCluster, impl: str, args: argparse.Namespace, workdir: Path) -> Any:
    script, ckpt = workdir / "preempt.py", workdir / "ckpt"
    script.write_text(PREEMPT_WORKER)
    ckpt.mkdir()
    first = slurm.cluster.hosts[0].name
    flags = ["--nproc-per-node=2"]
    if impl == "torchrun":  # what makes torchrun one job of the step's nodes
        flags += ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={first}:29400"]
        flags += ["--rdzv-id=slurm"]
    cmd = ["srun", "-N2", "--ntasks-per-node=1", *launcher(impl), *flags, str(script)]
    cmd += [str(ckpt), "100000", str(args.every), str(args.pause)]
    env = slurm.env({"FAULTS_OUT": str(workdir), "OMP_NUM_THREADS": "1"})
    proc = slurm.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def last(kind: str) -> int:
        return max((e["step"] for e in read_events(workdir) if e["event"] == kind), default=0)

    try:
        if not wait_until(lambda: last("step") >= args.at, 180, 0.05):
            return {"result": "did not train", "logs": proc_output(proc)}
        (job,) = slurm.queue()
        signalled = time.monotonic()
        slurm.run(["scancel", "--signal=TERM", f"{job}.0"])
        proc.wait(timeout=120)
        ended = time.monotonic() - signalled
    finally:
        slurm.cancel_all()
    lost = last("step") - last("saved")
    return {
        "steps_lost": lost,
        "ended_s": round(ended, 2),
        "srun_exit": proc.returncode,
        "result": f"{lost} steps lost, step ended {ended:.2f} s after the signal",
        "logs": proc_output(proc),
    }


def proc_output(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    return (proc.communicate()[0] or "")[-4000:]


def in_scratch(run: Any) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    try:
        return dict(run(workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--every", type=int, default=20, help="periodic checkpoint, in steps")
    parser.add_argument("--at", type=int, default=25, help="SIGTERM after this many steps")
    parser.add_argument("--pause", type=float, default=0.1, help="s each step sleeps")
    parser.add_argument("--json", dest="json_path", help="also write the JSON here")
    args = parser.parse_args()
    for ok, why in (cluster_available(), slurm_available()):
        if not ok:
            sys.exit(f"bench/slurm.py: {why}")
    impls = [i for i in args.impls.split(",") if i]
    if set(impls) - set(IMPLS):
        sys.exit(f"bench/slurm.py: --impls: expected some of {', '.join(IMPLS)}")
    load_before = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    with Cluster(3) as cluster, SlurmCluster(cluster, Path(tempfile.mkdtemp())) as slurm:
        for rep in range(args.repeat):
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                for case in ("one job", "whole step"):
                    if case == "one job":
                        out = in_scratch(lambda w, i=impl: one_job(slurm, i, w))
                    else:
                        out = in_scratch(lambda w, i=impl: whole_step(slurm, i, args, w))
                    out.update(impl=impl, case=case, repeat=rep)
                    print(f"# {impl} {case} #{rep}: {out['result']}", file=sys.stderr, flush=True)
                    runs.append(out)
        shutil.rmtree(slurm.workdir, ignore_errors=True)
    print(
        "| launcher | srun -N2 ... --nproc-per-node=2 | whole step SIGTERMed: steps lost "
        "| signal -> step ended |"
    )
    print("| --- | --- | --- | --- |")
    for impl in impls:
        ones = [r for r in runs if r["impl"] == impl and r["case"] == "one job"]
        steps = [r for r in runs if r["impl"] == impl and r["case"] == "whole step"]
        shapes = sorted({f"{r['jobs']} job(s) of {r['worlds']}" for r in ones})
        good = [r for r in steps if "steps_lost" in r]
        lost = spread([r["steps_lost"] for r in good], "g") if good else "?"
        ended = spread([r["ended_s"] for r in good], ".2f") + " s" if good else "?"
        print(
            f"| {impl} | {'; '.join(shapes)} in {spread([r['srun_s'] for r in ones], '.2f')} s "
            f"| {lost} (of {len(good)}/{len(steps)} runs) | {ended} |"
        )
    report = {
        "command": command_line(),
        "commit": commit(),
        "load1_before": round(load_before, 2),
        "load1_after": round(os.getloadavg()[0], 2),
    }
    write_runs_report(report, runs, args.json_path)


if __name__ == "__main__":
    main()
