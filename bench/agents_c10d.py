"""N agents on loopback with the c10d rendezvous: ``elastic run`` against ``torchrun``.

Each run starts N agents (default 8) as separate processes, each with
``--nnodes=N --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:<free port>
--rdzv-id=<unique>``; ours is ``python -m elastic run``, torchrun is
``python -m torch.distributed.run``. The worker (``workers/allreduce.py``) writes
``time.time()`` as its first statement, then does ``init_process_group("gloo")``, one
``all_reduce`` and ``destroy_process_group``.

Measured per run, from just before the first agent's ``Popen``:

  wall      until every agent has exited (every exit code must be 0; failures are
            reported, not timed)
  workers   until the last of the N workers has started (its first statement)
  done      until the last worker has finished its all_reduce and destroyed the group
            (the rest of ``wall`` is the workers' and agents' exit)
  rss       each agent's peak RSS (``VmHWM`` in ``/proc/<pid>/status``, the agent process
            alone, not its workers), polled every ``--rss-poll`` s while it lives, so the
            last poll before it exits stands for its peak: the median over the N agents
  rss_max   the same, the largest of the N agents' peaks

The two launchers alternate (who goes first alternates each repetition) after a discarded
warm-up run of each. Each run is capped (``--timeout``, 120 s): on timeout every agent's
process group and every worker under it is SIGKILLed. Both launchers run with
``RES_OPTIONS="timeout:1 attempts:1"`` (see docs/benchmarks.md). Prints a table and JSON.

    python bench/agents_c10d.py --agents 8 --repeat 3 [--impls ours,torchrun] [--json out]
        [--rss-poll 0.05]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
    write_report,
)
from elastic.harness.processes import kill_tree, launcher_cmd, proc_status_kb
from elastic.testing.ports import free_port

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "allreduce.py"
METRICS = ("wall", "workers", "done", "rss", "rss_max")
UNITS = {"rss": "MB", "rss_max": "MB"}  # the others: s


def one_run(
    impl: str, agents: int, env: dict[str, str], work: Path, timeout: float, rss_poll: float
) -> dict[str, Any]:
    """Start ``agents`` agents of ``impl``; return wall/workers times or the failure."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"{impl}-", dir=work))
    port = free_port()
    cmd = [
        *launcher_cmd(impl),
        f"--nnodes={agents}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=bench-{uuid.uuid4().hex[:12]}",
        "--max-restarts=0",
        str(WORKER),
        str(out_dir),
    ]
    procs: list[subprocess.Popen[bytes]] = []
    exits: dict[int, tuple[int, float]] = {}
    lock = threading.Lock()

    def waiter(index: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        with lock:
            exits[index] = (code, time.time())

    threads = []
    logs = [out_dir / f"agent{i}.log" for i in range(agents)]
    started = time.time()
    for i in range(agents):
        with open(logs[i], "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        procs.append(proc)
        thread = threading.Thread(target=waiter, args=(i, proc), daemon=True)
        thread.start()
        threads.append(thread)
    deadline = started + timeout
    peak_kb: dict[int, int] = {}
    while time.time() < deadline and any(thread.is_alive() for thread in threads):
        for i, proc in enumerate(procs):
            with lock:
                gone = i in exits
            kb = None if gone else proc_status_kb(proc.pid, "VmHWM")
            if kb is not None:  # None: exited, or a zombie (no memory left to measure)
                peak_kb[i] = max(peak_kb.get(i, 0), kb)
        time.sleep(rss_poll)
    timed_out = any(thread.is_alive() for thread in threads)
    for proc in procs:  # stragglers (timeout) and any orphaned worker (failure)
        kill_tree(proc.pid)
    for thread in threads:
        thread.join()
    starts = [json.loads(p.read_text())["t"] for p in out_dir.glob("start-*.json")]
    dones = [json.loads(p.read_text())["t"] for p in out_dir.glob("done-*.json")]
    result: dict[str, Any] = {"dir": str(out_dir), "port": port}
    codes = [exits[i][0] for i in range(agents)]
    if timed_out or any(codes) or len(starts) != agents or len(dones) != agents:
        tails = {
            f"agent{i}": logs[i].read_text(errors="replace")[-1500:]
            for i in range(agents)
            if timed_out or codes[i] != 0
        }
        result.update(
            ok=False,
            reason=f"timed out after {timeout:g}s" if timed_out else "non-zero exit",
            exit_codes=codes,
            workers_started=len(starts),
            workers_done=len(dones),
            log_tails=tails,
        )
        return result
    result.update(
        ok=True,
        wall=max(t for _, t in exits.values()) - started,
        workers=max(starts) - started,
        done=max(dones) - started,
        rss=statistics.median(peak_kb.values()) / 1024 if peak_kb else None,
        rss_max=max(peak_kb.values()) / 1024 if peak_kb else None,
    )
    return result


def render(results: dict[str, Any], impls: list[str], failures: dict[str, int]) -> str:
    columns = " ".join(f"{i + ' median [min-max]':>28}" for i in impls)
    head = f"{'metric':<8} {columns} {'ratio':>7}"
    lines = [head, "-" * len(head)]
    for metric, entry in results.items():
        cells = []
        for impl in impls:
            s = entry[impl]
            cell = (
                "-" if s["median"] is None else f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"
            )
            cells.append(cell.rjust(28))
        ratio = entry.get("ratio")
        lines.append(
            f"{metric:<8} " + " ".join(cells) + f" {'' if ratio is None else f'{ratio:.3f}':>7}"
        )
    lines.append("failed runs: " + ", ".join(f"{i} {failures[i]}" for i in impls))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="cap per run, seconds")
    parser.add_argument("--impls", default="ours,torchrun", help="comma list: ours,torchrun")
    parser.add_argument(
        "--rss-poll", type=float, default=0.05, help="s between VmHWM polls of the agents"
    )
    parser.add_argument("--keep-dirs", action="store_true", help="keep agent logs and stamps")
    add_report_options(parser)
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    env = bench_env(args)
    samples: dict[str, dict[str, list[float]]] = {m: {i: [] for i in impls} for m in METRICS}
    failed: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="elastic-agents-c10d-"))
    for _ in range(args.warmup):
        for impl in impls:
            r = one_run(impl, args.agents, env, work, args.timeout, args.rss_poll)
            print(f"  warmup {impl}: {'ok' if r['ok'] else r['reason']}", file=sys.stderr)
    for i in range(args.repeat):
        for impl in impls if i % 2 == 0 else impls[::-1]:
            r = one_run(impl, args.agents, env, work, args.timeout, args.rss_poll)
            if r["ok"]:
                for metric in METRICS:
                    if r[metric] is not None:
                        samples[metric][impl].append(r[metric])
                note = " ".join(
                    f"{m} {r[m]:.2f}{UNITS.get(m, 's')}" for m in METRICS if r[m] is not None
                )
            else:
                failed[impl].append({"repeat": i, **r})
                note = f"FAILED ({r['reason']}, exit codes {r['exit_codes']}, dir {r['dir']})"
            print(f"  {impl} #{i}: {note}", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    results: dict[str, Any] = {}
    for metric in METRICS:
        entry: dict[str, Any] = {i: sample_stats(samples[metric][i], 3) for i in impls}
        entry["unit"] = UNITS.get(metric, "s")
        if {"ours", "torchrun"} <= set(impls) and entry["torchrun"]["median"]:
            ours = entry["ours"]["median"]
            entry["ratio"] = None if ours is None else round(ours / entry["torchrun"]["median"], 3)
        results[metric] = entry
    report = {
        "command": command_line(),
        "launchers": {i: launcher_cmd(i) for i in impls},
        "agents": args.agents,
        "repeat": args.repeat,
        "warmup": args.warmup,
        "timeout": args.timeout,
        "res_options": env.get("RES_OPTIONS"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "results": results,
        "failures": failed,
    }
    print(render(results, impls, {i: len(failed[i]) for i in impls}))
    print(
        f"load average before {report['machine']['loadavg_before']}, after "
        f"{report['machine']['loadavg_after']}"
    )
    write_report(report, args.json_path)
    if not args.keep_dirs and not any(failed.values()):
        shutil.rmtree(work, ignore_errors=True)
    elif any(failed.values()) or args.keep_dirs:
        print(f"agent logs kept in {work}", file=sys.stderr)
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
