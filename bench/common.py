"""Plumbing shared by the bench scripts: the launchers, ports, process trees, statistics.

The scripts run as ``python bench/NAME.py``, so this directory is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
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
