"""Plumbing shared by the bench scripts: the launchers, ports, process trees, statistics.

The scripts run as ``python bench/NAME.py``, so this directory is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def module_launcher(impl: str) -> list[str]:
    """``python -m`` form of launcher ``impl`` ("ours" or "torchrun")."""
    if impl == "ours":
        return [sys.executable, "-m", "elastic", "run"]
    if impl == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run"]
    raise ValueError(impl)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant's process group."""
    for target in [pid, *descendants(pid)]:
        try:
            os.killpg(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def sample_stats(samples: list[float], digits: int = 4) -> dict[str, Any]:
    """Median and spread of repeated measurements."""
    return {
        "samples": [round(s, digits) for s in samples],
        "median": round(statistics.median(samples), digits),
        "min": round(min(samples), digits),
        "max": round(max(samples), digits),
        "stdev": round(statistics.stdev(samples), digits) if len(samples) > 1 else 0.0,
    }


def write_report(report: dict[str, Any], json_path: str | None) -> None:
    """Print the JSON report, and also write it to ``json_path`` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def add_report_options(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--keep-resolver``, the options every side-by-side bench takes."""
    parser.add_argument("--json", dest="json_path", help="also write the JSON here")
    parser.add_argument(
        "--keep-resolver",
        action="store_true",
        help="don't set RES_OPTIONS='timeout:1 attempts:1' (see docs/benchmarks.md)",
    )


def bench_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment both launchers run in. torch's TCPStore client does a reverse DNS
    query per connection and a lost query costs the resolver's 5 s timeout, so unless
    ``--keep-resolver`` both sides get a short resolver timeout."""
    env = dict(os.environ)
    if not args.keep_resolver:
        env["RES_OPTIONS"] = "timeout:1 attempts:1"
    return env


def proc_cpu_seconds(pid: int) -> float | None:
    """utime+stime of ``pid`` itself (not its children) from ``/proc/<pid>/stat``; None
    once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_kb(pid: int, field: str = "VmHWM") -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmHWM``: peak RSS); None once gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def mem_available_mb() -> float:
    """``MemAvailable`` from ``/proc/meminfo``, in MB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def listening_pid(port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the TCP socket listening on ``port`` (any address), found
    through the socket's inode in ``/proc/net/tcp{,6}`` and the processes' fds."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    return pid
            except OSError:
                continue
    return None


def raise_nofile(wanted: int) -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` towards ``wanted`` (up to the hard limit); the
    children inherit it. Returns the (soft, hard) limits now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def pytest_running() -> bool:
    """Whether any process's command line mentions pytest (``pgrep -f pytest``)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"pytest" in cmdline:
            return True
    return False


def wait_for_quiet(max_load: float, limit: float, poll: float = 30.0) -> dict[str, Any]:
    """Wait (up to ``limit`` s, checking every ``poll`` s) until the 1-min load average is
    below ``max_load`` and no pytest runs; then go on either way. Returns what was seen."""
    import time

    started = time.monotonic()
    while True:
        load = os.getloadavg()[0]
        busy = pytest_running()
        waited = time.monotonic() - started
        if (load < max_load and not busy) or waited >= limit:
            return {
                "quiet": load < max_load and not busy,
                "waited_s": round(waited, 1),
                "load1": round(load, 2),
                "pytest_running": busy,
            }
        print(
            f"  waiting for a quiet machine: load {load:.2f}, pytest running: {busy}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(poll)


def in_scratch_dir(
    prefix: str, keep: str | None, run: Callable[[Path], dict[str, Any]]
) -> tuple[dict[str, Any], float]:
    """``run(workdir)`` in a fresh temporary directory, copied under ``keep`` (when
    given) and removed afterwards; returns its result and the seconds it took."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    started = time.monotonic()
    try:
        return run(workdir), time.monotonic() - started
    finally:
        if keep:
            shutil.copytree(workdir, Path(keep) / workdir.name)
        shutil.rmtree(workdir, ignore_errors=True)
