"""Hang benchmark: from a hang to the restart, ``elastic run --stall-timeout`` against
``torchrun`` (torch 2.13's ``torch.distributed.run``), side by side in one run.

The job (``--standalone --nproc-per-node=2 --max-restarts=1``, ``workers/hang.py``): gloo
all_reduces, then on attempt 0 rank 1 sleeps forever instead of joining the next one
while rank 0 waits in it. torchrun does nothing about a hang: the job only moves on when
gloo's collective timeout fires in rank 0 (it raises, torchrun restarts). torch's default
is 30 minutes, so the workers get a short one (``--gloo-timeout``, default 30 s) for this
bench to end; ours finds the stall after ``--stall-timeout`` (default 5 s) with the same
workers and the same gloo timeout.

Measured per run: ``restart`` = from the hang (rank 1's timestamp right before it sleeps)
to the first worker of attempt 1 starting (its first statement); ``finished`` = the job
exited 0. Launchers alternate run by run (who goes first alternates), both with
``RES_OPTIONS="timeout:1 attempts:1"``.

    python bench/hang.py --repeat 3 [--stall-timeout 5] [--gloo-timeout 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from elastic.harness.benchmarking import add_report_options, bench_env, sample_stats, write_report
from elastic.harness.processes import kill_tree, launcher_cmd

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "hang.py"


def stamps(out: Path, kind: str) -> list[float]:
    return [json.loads(p.read_text())["t"] for p in out.glob(f"{kind}-*.json")]


def one_run(impl: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"hang-{impl}-"))
    cmd = [*launcher_cmd(impl), "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    if impl == "ours":
        cmd.append(f"--stall-timeout={args.stall_timeout}")
    cmd += [str(WORKER), str(out), str(args.gloo_timeout)]
    cap = args.gloo_timeout + 120
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=cap)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        _, err = proc.communicate()
        return {"finished": False, "restart": None, "note": f"still running after {cap:.0f}s"}
    hang = stamps(out, "hang")
    restarted = [t for p in out.glob("start-1-*.json") for t in [json.loads(p.read_text())["t"]]]
    result: dict[str, Any] = {"finished": proc.returncode == 0, "exit": proc.returncode}
    result["restart"] = min(restarted) - hang[0] if hang and restarted else None
    if result["restart"] is None or proc.returncode != 0:
        result["stderr_tail"] = err.strip().splitlines()[-5:]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stall-timeout", type=float, default=5.0)
    parser.add_argument("--gloo-timeout", type=float, default=30.0)
    parser.add_argument("--impls", default="ours,torchrun")
    add_report_options(parser)
    args = parser.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    env = bench_env(args)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
    for i in range(args.repeat):
        for impl in impls if i % 2 == 0 else impls[::-1]:
            result = one_run(impl, args, env)
            runs[impl].append(result)
            restart = result["restart"]
            shown = f"{restart:.2f}s" if restart is not None else "-"
            print(f"run {i} {impl:>8}: hang -> restart {shown}, finished={result['finished']}")
    results = {}
    for impl, rs in runs.items():
        samples = [r["restart"] for r in rs if r["restart"] is not None]
        results[impl] = {
            "restart_seconds": sample_stats(samples) if samples else None,
            "finished": sum(r["finished"] for r in rs),
            "runs": rs,
        }
    print()
    print(f"{'launcher':<10} {'hang -> restart, median [min-max] (s)':<40} finished")
    for impl in impls:
        stats = results[impl]["restart_seconds"]
        text = f"{stats['median']:.2f} [{stats['min']:.2f}-{stats['max']:.2f}]" if stats else "-"
        print(f"{impl:<10} {text:<40} {results[impl]['finished']}/{args.repeat}")
    ours, peer = (results.get(k, {}).get("restart_seconds") for k in ("ours", "torchrun"))
    ratio = round(ours["median"] / peer["median"], 3) if ours and peer else None
    if ratio is not None:
        print(
            f"ours / torchrun: {ratio} (torchrun waited gloo's timeout of {args.gloo_timeout:g}s,"
        )
        print("  shortened for this bench: torch's default is 1800s)")
    report = {
        "bench": "hang",
        "stall_timeout": args.stall_timeout,
        "gloo_timeout": args.gloo_timeout,
        "repeat": args.repeat,
        "ratio_ours_torchrun": ratio,
        "results": results,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
    }
    write_report(report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
