"""Launch benchmark: ``elastic run`` against ``torchrun``, side by side in one run.

Scenarios (each repeated ``--repeat`` times, the two launchers interleaved so machine
noise hits both alike; a ``--warmup`` run of each is discarded):

  launch   command -> every worker started (``--standalone --nproc-per-node=2``); the
           workers' first statement is ``time.time()``, the bench reads the clock just
           before ``Popen``.
  restart  a worker exits 1 on attempt 0; from its exit timestamp (written right before
           it exits) to the first worker of attempt 1 starting (``--max-restarts=1``).
  warm     the same, the worker failing 4 s after its start, ours with
           ``--warm-restarts`` (its spares are made 2 s after a start): what a restart
           costs a job whose workers ran a while, torchrun's the same as ``restart``.
  rss      the launcher process's peak RSS (VmHWM from /proc/<pid>/status, sampled while
           the workers sleep, so the last sample is taken just before the agent exits).
  help     ``elastic --help`` against ``torchrun --help``, wall time.

Prints a table (median, min-max, ratio ours/torchrun, target) and then JSON.

Bytecode: this environment sets ``PYTHONDONTWRITEBYTECODE=1`` and the project is an
editable install without ``__pycache__``, so every launch of ours would compile its ~100
modules afresh (~90 ms of CPU), while torch's came compiled with its wheel, as ours do
from a real install. ``--bytecode cached`` (the default, as in ``agents_scale.py``) gives
both launchers and their workers a ``PYTHONPYCACHEPREFIX``, filled by the warm-up runs;
``--bytecode env`` runs as the environment says (how the launch figures were measured
before this option).

Install: ``--install wheel`` (the default) runs both launchers with an interpreter of an
environment that has this checkout installed from a wheel, as users install it, and
torch from this one (``elastic.harness.installed_copy``): the development install's
editable import hook, loaded by every interpreter of its environment, is no part of a
user's launch. ``--install editable`` runs them with this interpreter (as before this
option; ``ELASTIC_BENCH_INSTALL=editable`` sets the default, for ``regress.py``).

    python bench/launch.py --repeat 5 [--impls ours,torchrun] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from agents_scale_startup import (
    add_bytecode_options,
    add_install_options,
    bench_python,
    bytecode_env,
)
from elastic.harness.benchmarking import (
    add_report_options,
    bench_env,
    command_line,
    sample_stats,
    write_report,
)
from elastic.harness.processes import proc_status_kb

HERE = Path(__file__).resolve().parent
PROBE = HERE / "workers" / "probe.py"
SCENARIOS = ("launch", "restart", "warm", "rss", "help")
# Ours / torchrun, lower is better; the targets come from the project's issue 2.
TARGETS = {"launch": 0.3, "restart": 0.5, "warm": 0.25, "rss": 0.25, "help": None}
UNITS = {"launch": "s", "restart": "s", "warm": "s", "rss": "MiB", "help": "s"}
RUN_TIMEOUT = 120.0


class BenchError(RuntimeError):
    pass


def launcher(impl: str, python: Path) -> list[str]:
    """The command that starts launcher ``impl``: its console script beside ``python``
    (no pyenv shims), as users type it."""
    script = python.parent / ("elastic" if impl == "ours" else "torchrun")
    if script.exists():
        return [str(script), "run"] if impl == "ours" else [str(script)]
    module = "elastic" if impl == "ours" else "torch.distributed.run"
    return [str(python), "-m", module, *(["run"] if impl == "ours" else [])]


def job_command(
    impl: str, python: Path, out_dir: Path, mode: str, max_restarts: int = 0, warm: bool = False
) -> list[str]:
    return [
        *launcher(impl, python),
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        *(["--warm-restarts"] if warm and impl == "ours" else []),
        str(PROBE),
        str(out_dir),
        mode,
    ]


def read_stamps(out_dir: Path, kind: str) -> dict[tuple[int, str], float]:
    stamps = {}
    for path in out_dir.glob(f"{kind}-*.json"):
        data = json.loads(path.read_text())
        stamps[(data["attempt"], data["rank"])] = data["t"]
    return stamps


def run_job(
    cmd: list[str], env: dict[str, str], log: Path, sample_rss: bool = False
) -> tuple[float, float, int | None]:
    """Run one launch to completion: (launch time, duration, peak RSS KiB or None)."""
    peak: list[int | None] = [None]
    with open(log, "w") as out:
        launched = time.time()  # just before Popen: the user's "command" moment
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        sampler = None
        if sample_rss:

            def sample() -> None:
                # VmHWM only grows, so the last read before exit is the peak.
                while proc.poll() is None:
                    value = proc_status_kb(proc.pid, "VmHWM")
                    if value is not None:
                        peak[0] = value
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
        try:
            code = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise BenchError(f"timed out after {RUN_TIMEOUT:g}s: {' '.join(cmd)}") from None
        duration = time.time() - launched
        if sampler is not None:
            sampler.join()
    if code != 0:
        tail = log.read_text()[-2000:]
        raise BenchError(f"exit {code}: {' '.join(cmd)}\n--- output tail ---\n{tail}")
    return launched, duration, peak[0]


def measure(scenario: str, impl: str, env: dict[str, str], work: Path, python: Path) -> float:
    """One sample of ``scenario`` for ``impl`` run by ``python``, in the scenario's unit."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"{scenario}-{impl}-", dir=work))
    log = out_dir / "launcher.log"
    if scenario == "help":
        cmd = launcher(impl, python)
        cmd = cmd[:-1] if impl == "ours" else cmd  # drop "run"
        start = time.perf_counter()
        subprocess.run([*cmd, "--help"], env=env, check=True, capture_output=True)
        return time.perf_counter() - start
    if scenario == "launch":
        launched, _, _ = run_job(job_command(impl, python, out_dir, "start"), env, log)
        starts = read_stamps(out_dir, "start")
        if len(starts) != 2:
            raise BenchError(f"{impl}: expected 2 worker start stamps, got {sorted(starts)}")
        return max(starts.values()) - launched
    if scenario in ("restart", "warm"):
        mode, warm = ("restart:4", True) if scenario == "warm" else ("restart", False)
        run_job(job_command(impl, python, out_dir, mode, max_restarts=1, warm=warm), env, log)
        failed = read_stamps(out_dir, "fail")
        starts = read_stamps(out_dir, "start")
        second = [t for (attempt, _), t in starts.items() if attempt == 1]
        if len(failed) != 1 or not second:
            raise BenchError(f"{impl}: no failure/attempt-1 stamps in {out_dir}")
        return min(second) - next(iter(failed.values()))
    if scenario == "rss":
        command = job_command(impl, python, out_dir, "sleep:1.5")
        _, _, peak = run_job(command, env, log, sample_rss=True)
        if peak is None:
            raise BenchError(f"{impl}: could not sample the launcher's VmHWM")
        return peak / 1024
    raise ValueError(scenario)


def render(results: dict[str, Any], impls: list[str]) -> str:
    columns = " ".join(f"{i + ' median [min-max]':>30}" for i in impls)
    head = f"{'scenario':<9} {'unit':<4} {columns}"
    lines = [head + f" {'ratio':>7} {'target':>7}  met", "-" * (len(head) + 26)]
    for scenario, entry in results.items():
        cells = []
        for impl in impls:
            s = entry[impl]
            cells.append(f"{s['median']:>10.3f} [{s['min']:.3f}-{s['max']:.3f}]".rjust(30))
        ratio = entry.get("ratio")
        target = entry.get("target")
        met = entry.get("met")
        lines.append(
            f"{scenario:<9} {UNITS[scenario]:<4} "
            + " ".join(cells)
            + f" {'' if ratio is None else f'{ratio:.3f}':>7}"
            + f" {'' if target is None else f'<={target}':>7}"
            + f"  {'' if met is None else ('yes' if met else 'NO')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--impls", default="ours,torchrun", help="comma list: ours,torchrun")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    add_bytecode_options(parser, "the warm-up runs")
    add_install_options(parser)
    add_report_options(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except BenchError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    impls = [i for i in args.impls.split(",") if i]
    scenarios = [s for s in args.scenarios.split(",") if s]
    env = bytecode_env(bench_env(args), args.bytecode, args.pycache_prefix)
    python, env = bench_python(args.install, env)
    if args.bytecode == "cached" and args.warmup < 1:
        raise BenchError("--bytecode cached needs a warm-up run (--warmup 1) to fill the cache")
    samples: dict[str, dict[str, list[float]]] = {s: {i: [] for i in impls} for s in scenarios}
    load_before = os.getloadavg()  # the machine is shared: say how busy it was
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        work = Path(tmp)
        for scenario in scenarios:
            for _ in range(args.warmup):
                for impl in impls:
                    measure(scenario, impl, env, work, python)
            for i in range(args.repeat):
                order = impls if i % 2 == 0 else impls[::-1]  # alternate who goes first
                for impl in order:
                    samples[scenario][impl].append(measure(scenario, impl, env, work, python))
                    print(
                        f"  {scenario} {impl} #{i}: {samples[scenario][impl][-1]:.4f}",
                        file=sys.stderr,
                        flush=True,
                    )
    results: dict[str, Any] = {}
    for scenario in scenarios:
        entry: dict[str, Any] = {i: sample_stats(samples[scenario][i]) for i in impls}
        entry["unit"] = UNITS[scenario]
        if {"ours", "torchrun"} <= set(impls):
            entry["ratio"] = round(entry["ours"]["median"] / entry["torchrun"]["median"], 3)
            entry["target"] = TARGETS[scenario]
            entry["met"] = None if entry["target"] is None else entry["ratio"] <= entry["target"]
        results[scenario] = entry
    report = {
        "command": command_line(),
        "launchers": {i: launcher(i, python) for i in impls},
        "install": {"mode": args.install, "python": str(python)},
        "repeat": args.repeat,
        "warmup": args.warmup,
        "res_options": env.get("RES_OPTIONS"),
        "bytecode": {
            "mode": args.bytecode,
            "PYTHONPYCACHEPREFIX": env.get("PYTHONPYCACHEPREFIX"),
            "PYTHONDONTWRITEBYTECODE": env.get("PYTHONDONTWRITEBYTECODE"),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "results": results,
    }
    print(render(results, impls))
    print(f"load average (1 min) before/after: {report['machine']['loadavg_1m_before_after']}")
    write_report(report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
