"""Before ``agents_scale.py`` times anything: the interpreter that runs the launchers
(``bench_python``, option ``--install``) and the bytecode it reads (``bytecode_env``,
options ``add_bytecode_options``; ``launch.py`` uses both too), a priming 1-node job of
each launcher that fills it (``prime``), and one agent's start-up alone
(``startup_profile``: ``--help``'s CPU, the heaviest imports)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agents_scale_job import Job
from elastic.harness.benchmarking import sample_stats
from elastic.harness.installed_copy import installed_python, without_checkout
from elastic.harness.processes import launcher_cmd


def prime(env: dict[str, str], impls: list[str], work: Path, python: Path) -> dict[str, float]:
    """One 1-node c10d job of each launcher, so every module an agent or a worker imports
    has its bytecode in the cache before anything is timed. Returns each one's wall time."""
    took = {}
    for impl in impls:
        job = Job(impl, 1, "start", env, work, python=python)
        try:
            job.start()
            job.wait(lambda job=job: job.alive() == 0, job.started + 300, 0.0)
        finally:
            job.kill()
        took[impl] = round(time.time() - job.started, 2)
    return took


def add_bytecode_options(parser: argparse.ArgumentParser, filled_by: str) -> None:
    """``--bytecode`` and ``--pycache-prefix`` (``bytecode_env``); ``filled_by``: what
    writes the cache before anything is timed."""
    parser.add_argument(
        "--bytecode",
        choices=("cached", "env"),
        default="cached",
        help=f"cached: every interpreter reads bytecode from --pycache-prefix, written by "
        f"{filled_by}; env: as the environment says (PYTHONDONTWRITEBYTECODE=1 makes "
        "ours compile the project's modules on every start)",
    )
    parser.add_argument("--pycache-prefix", default="/tmp/elastic-bench-pycache")


def add_install_options(parser: argparse.ArgumentParser) -> None:
    """``--install``: which interpreter runs both launchers and their workers
    (``bench_python``)."""
    parser.add_argument(
        "--install",
        choices=("wheel", "editable"),
        default=os.environ.get("ELASTIC_BENCH_INSTALL", "wheel"),
        help="wheel: an environment with this checkout installed from a wheel, as users "
        "install it (the editable install's import hook, loaded by every interpreter of "
        "the development environment, costs each one a few imports); editable: this "
        "interpreter (default from ELASTIC_BENCH_INSTALL, else wheel)",
    )


def bench_python(mode: str, env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """The interpreter that runs the launchers (``add_install_options``), and ``env`` for
    it: with the wheel, no ``PYTHONPATH`` (a checkout there would shadow the wheel)."""
    if mode == "editable":
        return Path(sys.executable), env
    return installed_python(), without_checkout(env)


def bytecode_env(env: dict[str, str], mode: str, prefix: str) -> dict[str, str]:
    """``cached``: bytecode is written once to (and read from) ``prefix`` for every module,
    the project's included, whatever ``PYTHONDONTWRITEBYTECODE`` says; ``env``: as the
    environment has it."""
    if mode == "env":
        return env
    env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = prefix
    return env


def startup_profile(env: dict[str, str], impls: list[str], python: Path) -> dict[str, Any]:
    """One agent's start-up alone: ``--help``'s CPU, and the heaviest imports."""
    out: dict[str, Any] = {}
    for impl in ["python", *impls]:
        cmd = [str(python), "-c", "pass"] if impl == "python" else launcher_cmd(impl, python)
        if impl != "python":
            cmd.append("--help")
        cpus, walls = [], []
        for _ in range(5):
            t = time.time()
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
            )
            _, _, usage = os.wait4(proc.pid, 0)
            walls.append(time.time() - t)
            cpus.append(usage.ru_utime + usage.ru_stime)
        entry: dict[str, Any] = {
            "command": " ".join(cmd),
            "cpu_s": sample_stats(cpus, 3),
            "wall_s": sample_stats(walls, 3),
        }
        if impl != "python":
            proc = subprocess.run(
                [str(python), "-X", "importtime", *cmd[1:]],
                capture_output=True,
                text=True,
                env=env,
            )
            rows = []
            for line in proc.stderr.splitlines():
                m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
                if m:
                    rows.append((int(m[2]), len(m[3]) // 2, m[4]))
            total = sum(c for c, depth, _ in rows if depth == 0)
            top = sorted((r for r in rows if r[1] <= 1), reverse=True)[:12]
            entry["import_total_ms"] = round(total / 1000, 1)
            entry["imports_ms"] = {name: round(c / 1000, 1) for c, _, name in top}
        out[impl] = entry
    return out
