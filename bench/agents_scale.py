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
Install: ``--install wheel`` (the default) runs every agent, ours and torchrun's, with an
interpreter that has this checkout installed from a wheel, as users install it, without
the development install's editable import hook (``launch.py``'s docstring says more);
``--install editable`` runs them with this interpreter.
``--ours-args``/``--torchrun-args`` add launcher options (e.g.
``--rdzv-conf=heartbeat_timeout=30``).

``--startup`` also measures one agent's start-up alone: CPU time of ``<launcher> --help``
(median of 5) and the largest cumulative imports of ``python -X importtime``.

The jobs and the two kinds of run are in ``agents_scale_job.py``; the interpreter, the
bytecode, the priming jobs and the start-up profile in ``agents_scale_startup.py``.

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
import os
import platform
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agents_scale_job import heartbeat_run, scale_run  # noqa: E402  (beside this file)
from agents_scale_startup import (  # noqa: E402
    add_bytecode_options,
    add_install_options,
    bench_python,
    bytecode_env,
    prime,
    startup_profile,
)
from elastic.harness.benchmarking import (  # noqa: E402
    add_report_options,
    bench_env,
    command_line,
    sample_stats,
    wait_for_quiet,
    write_report,
)
from elastic.harness.processes import launcher_cmd, raise_nofile  # noqa: E402

METRICS = ("workers", "wall", "cpu_median", "cpu_total")


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
    add_bytecode_options(parser, "a priming run first")
    add_install_options(parser)
    add_report_options(parser)
    args = parser.parse_args(argv)
    args.extra = {"ours": shlex.split(args.ours_args), "torchrun": shlex.split(args.torchrun_args)}
    impls = [i for i in args.impls.split(",") if i]
    node_list = [int(n) for n in args.nodes.split(",") if n]
    env = bytecode_env(bench_env(args), args.bytecode, args.pycache_prefix)
    args.python, env = bench_python(args.install, env)
    nofile = raise_nofile(args.nofile)
    quiet = wait_for_quiet(args.max_load, args.wait_quiet) if args.wait_quiet else None
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="elastic-agents-scale-"))
    failed_any = False
    report: dict[str, Any] = {
        "command": command_line(),
        "launchers": {i: [*launcher_cmd(i, args.python), *args.extra[i]] for i in impls},
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
    report["install"] = {"mode": args.install, "python": str(args.python)}
    report["prime_s"] = prime(env, primed, work, args.python)
    note(f"primed: {report['prime_s']}")
    if args.startup:
        report["startup"] = startup_profile(env, impls, args.python)
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
