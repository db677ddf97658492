"""Restart reliability: a checkpointing gloo DDP job with one worker SIGKILLed per run.

Checks the claim of issue 2: under torchrun 2.13 (``--standalone --nproc-per-node=2
--max-restarts=2``) a DDP job whose worker is SIGKILLed once often does not finish
(restarted attempts fail in gloo's ``connectFullMesh``, or hang in
``init_process_group``); ours must finish every run with the same final weights as a run
without failures.

Each run: a fresh checkpoint directory; the launcher runs ``examples/ddp_train.py
--steps S --sleep T --checkpoint-dir DIR --progress-dir DIR --out params.json``; when the
chosen rank's progress file (``rank<N>.json``: pid, step) reaches the chosen step, that
pid is SIGKILLed, once. The kill rank and step come from a seeded RNG per run index, so
run i kills the same rank at the same step for both launchers. Then the bench waits for
the launcher to exit: exit 0 = finished, non-zero = failed, still running ``--timeout``
seconds after the kill = hung (the processes under the launcher are listed, their Python
stacks dumped with ``py-spy`` when it is installed, into ``hang-stacks.txt``, then all
SIGKILLed). A finished run's ``params.json`` (float.hex of every parameter) is compared
byte for byte with a reference run of the same launcher without failures.

The launchers alternate run by run (who goes first alternates), both with
``RES_OPTIONS="timeout:1 attempts:1"`` (see docs/benchmarks.md). Prints a table and JSON;
every run's launcher output is kept under ``--log-dir``.

    python bench/restart_reliability.py --runs 20 [--torch-runs N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic.harness.benchmarking import add_report_options, bench_env, command_line, write_report
from elastic.harness.processes import descendants, kill_tree, launcher_cmd

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "ddp_train.py"
OUTCOMES = ("finished", "failed", "hung")


def kill_stray_workers(pids: set[int]) -> list[int]:
    """SIGKILL workers (seen in progress files) that outlived their launcher."""
    killed = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if SCRIPT.name.encode() in cmdline:  # not a recycled pid
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def snapshot(root: int, path: Path) -> list[dict[str, Any]]:
    """Before killing a hung job: every process under it (state, command) and, when
    ``py-spy`` is installed, each one's Python stacks, written to ``path``."""
    procs = []
    chunks = []
    for pid in [root, *descendants(root)]:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state = stat.rsplit(")", 1)[1].split()[0]
        procs.append({"pid": pid, "state": state, "cmd": cmdline.strip()[-200:]})
        chunks.append(f"=== pid {pid} state {state}: {cmdline.strip()}")
        if shutil.which("py-spy"):
            dump = subprocess.run(
                ["py-spy", "dump", "--native", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            chunks.append(dump.stdout + dump.stderr)
    path.write_text("\n".join(chunks) + "\n")
    return procs


def read_progress(progress: Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads((progress / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def one_run(
    impl: str,
    run_dir: Path,
    args: argparse.Namespace,
    env: dict[str, str],
    kill: tuple[int, int] | None,
) -> dict[str, Any]:
    """One job; ``kill`` = (rank, step) to SIGKILL that rank's worker at, or None."""
    run_dir.mkdir(parents=True)
    progress, ckpt, out = run_dir / "progress", run_dir / "ckpt", run_dir / "params.json"
    progress.mkdir()
    ckpt.mkdir()
    cmd = [
        *launcher_cmd(impl),
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={args.max_restarts}",
        str(SCRIPT),
        f"--steps={args.steps}",
        f"--sleep={args.sleep}",
        f"--checkpoint-dir={ckpt}",
        f"--progress-dir={progress}",
        f"--out={out}",
    ]
    log = run_dir / "launcher.log"
    result: dict[str, Any] = {"dir": str(run_dir)}
    seen_pids: set[int] = set()
    with open(log, "wb") as f:
        started = time.time()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    deadline = started + args.timeout
    if kill is not None:
        rank, step = kill
        result["kill_rank"], result["kill_step"] = rank, step
        while proc.poll() is None and time.time() < deadline:
            for r in range(2):
                p = read_progress(progress, r)
                if p:
                    seen_pids.add(int(p["pid"]))
            p = read_progress(progress, rank)
            if p and p["step"] >= step:
                try:
                    os.kill(int(p["pid"]), signal.SIGKILL)
                    result["killed"] = {"pid": p["pid"], "at_step": p["step"]}
                except ProcessLookupError:
                    result["killed"] = None  # it had already gone
                deadline = time.time() + args.timeout  # the hang clock starts at the kill
                break
            time.sleep(0.02)
        if "killed" not in result:
            result["killed"] = None
    try:
        code: int | None = proc.wait(timeout=max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        code = None
        result["hang_processes"] = snapshot(proc.pid, run_dir / "hang-stacks.txt")
        kill_tree(proc.pid)
        proc.wait()
    result["seconds"] = round(time.time() - started, 3)
    for r in range(2):
        p = read_progress(progress, r)
        if p:
            seen_pids.add(int(p["pid"]))
    strays = kill_stray_workers(seen_pids)
    if strays:
        result["stray_workers_killed"] = strays
    result["exit_code"] = code
    result["outcome"] = "hung" if code is None else "finished" if code == 0 else "failed"
    text = log.read_text(errors="replace")
    result["attempts_past_init"] = text.count("ddp_train: world=")  # rank 0, once per attempt
    result["connectFullMesh_lines"] = text.count("connectFullMesh")
    result["params"] = out.read_bytes() if out.exists() else None
    if result["outcome"] != "finished":
        result["log_tail"] = text[-3000:]
    return result


def summarize(runs: list[dict[str, Any]], reference: bytes | None) -> dict[str, Any]:
    counts = {o: sum(r["outcome"] == o for r in runs) for o in OUTCOMES}
    identical = sum(
        r["outcome"] == "finished" and reference is not None and r["params"] == reference
        for r in runs
    )
    finished_times = [r["seconds"] for r in runs if r["outcome"] == "finished"]
    return {
        "runs": len(runs),
        **counts,
        "identical_weights": identical,
        "killed": sum(bool(r.get("killed")) for r in runs),
        "median_seconds_finished": (
            round(statistics.median(finished_times), 2) if finished_times else None
        ),
        "min_max_seconds_finished": (
            [round(min(finished_times), 2), round(max(finished_times), 2)]
            if finished_times
            else None
        ),
        "median_seconds_all": round(statistics.median([r["seconds"] for r in runs]), 2)
        if runs
        else None,
        "runs_with_connectFullMesh": sum(r["connectFullMesh_lines"] > 0 for r in runs),
    }


def render(summary: dict[str, Any], impls: list[str]) -> str:
    cols = {
        "runs": "runs",
        "killed": "killed",
        "finished": "finished",
        "failed": "failed",
        "hung": "hung",
        "identical_weights": "identical",
        "runs_with_connectFullMesh": "connectFullMesh",
        "median_seconds_finished": "median s (finished)",
    }
    head = f"{'launcher':<9}" + "".join(f"{label:>{len(label) + 2}}" for label in cols.values())
    lines = [head, "-" * len(head)]
    for impl in impls:
        s = summary[impl]
        lines.append(
            f"{impl:<9}"
            + "".join(f"{str(s[key]):>{len(label) + 2}}" for key, label in cols.items())
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per launcher")
    parser.add_argument("--torch-runs", type=int, default=None, help="torchrun runs (--runs)")
    parser.add_argument("--impls", default="ours,torchrun", help="comma list: ours,torchrun")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sleep", type=float, default=0.1, help="seconds per step")
    parser.add_argument("--min-kill-step", type=int, default=3)
    parser.add_argument("--max-kill-step", type=int, default=25)
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=90.0, help="hang cap, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="keep every run's output here")
    add_report_options(parser)
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    planned = {i: args.runs for i in impls}
    if "torchrun" in planned and args.torch_runs is not None:
        planned["torchrun"] = args.torch_runs
    env = bench_env(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="elastic-restart-reliability-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs under {log_dir}", file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    bench_started = time.time()

    references: dict[str, dict[str, Any]] = {}
    for impl in impls:
        ref = one_run(impl, log_dir / f"{impl}-reference", args, env, kill=None)
        references[impl] = ref
        print(
            f"  {impl} reference: {ref['outcome']} in {ref['seconds']:.1f}s",
            file=sys.stderr,
            flush=True,
        )

    runs: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    for n in range(max(planned.values())):
        rng = random.Random(args.seed * 100_003 + n)
        kill = (rng.randrange(2), rng.randint(args.min_kill_step, args.max_kill_step))
        for impl in impls if n % 2 == 0 else impls[::-1]:
            if n >= planned[impl]:
                continue
            r = one_run(impl, log_dir / f"{impl}-{n:02d}", args, env, kill)
            ref_params = references[impl]["params"]
            r["identical"] = r["params"] is not None and r["params"] == ref_params
            runs[impl].append(r)
            print(
                f"  {impl} #{n}: kill rank {kill[0]} at step {kill[1]} -> {r['outcome']}"
                f" (exit {r['exit_code']}) in {r['seconds']:.1f}s,"
                f" identical={r['identical']}, attempts past init={r['attempts_past_init']},"
                f" connectFullMesh lines={r['connectFullMesh_lines']}",
                file=sys.stderr,
                flush=True,
            )

    summary = {i: summarize(runs[i], references[i]["params"]) for i in impls}
    refs_params = [references[i]["params"] for i in impls]
    report = {
        "command": command_line(),
        "launchers": {i: launcher_cmd(i) for i in impls},
        "job": {
            "script": str(SCRIPT.relative_to(ROOT)),
            "steps": args.steps,
            "sleep": args.sleep,
            "max_restarts": args.max_restarts,
            "kill_step_range": [args.min_kill_step, args.max_kill_step],
            "timeout_after_kill": args.timeout,
            "seed": args.seed,
        },
        "res_options": env.get("RES_OPTIONS"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "bench_seconds": round(time.time() - bench_started, 1),
        "references": {i: {k: v for k, v in references[i].items() if k != "params"} for i in impls},
        "references_identical_across_launchers": (
            None if None in refs_params else len(set(refs_params)) == 1
        ),
        "summary": summary,
        "runs": {
            i: [{k: v for k, v in r.items() if k != "params"} for r in runs[i]] for i in impls
        },
        "log_dir": str(log_dir),
    }
    print(render(summary, impls))
    m = report["machine"]
    print(f"load average before {m['loadavg_before']}, after {m['loadavg_after']}")
    write_report(report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
