"""What an agent's start imports: a real ``elastic run`` (standalone, and a one-node c10d
job) must not import what its run does not use. The bench (``bench/launch.py``,
``bench/agents_scale.py``) times the start; this keeps the lazy imports lazy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from elastic.testing.ports import free_port

# Modules a launch that uses none of their features must not import: the commands
# other than `run`, the metrics sinks (the metrics plugin looks them up on first use),
# multiprocessing (Python-callable workers only), the watchdog's built-ins (only with
# --stall-timeout, --health-port or the file timer), the etcd and prometheus extras,
# TLS, an HTTP server, and torch. (uuid and platform are click's own imports.)
NOT_IMPORTED = (
    "elastic.cli.plugins_cmd",
    "elastic.cli.status",
    "elastic.plugins.metrics.sinks",
    "multiprocessing",
    "elastic.core.watchdog.watch",
    "elastic.core.watchdog.stall",
    "elastic.core.watchdog.stacks",
    "elastic.core.watchdog.file_timer_plugin",
    "etcd",
    "urllib3",
    "prometheus_client",
    "ssl",
    "http.server",
    "torch",
)

RUN = """
import atexit, json, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted(sys.modules))))
sys.argv = ["elastic", "run", *ARGS]
from elastic.cli.main import main
main()
"""


def modules_of_a_run(args: list[str], tmp_path: Path) -> set[str]:
    code = RUN.replace("ARGS", repr(args))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("MODULES ")]
    return set(json.loads(line.removeprefix("MODULES ")))


def imported(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in NOT_IMPORTED or m in NOT_IMPORTED)


@pytest.mark.parametrize("backend", ["standalone", "c10d"])
def test_a_run_imports_nothing_it_does_not_use(tmp_path: Path, backend: str) -> None:
    script = tmp_path / "w.py"
    script.write_text("pass\n")
    flags = ["--standalone"]
    if backend == "c10d":
        flags = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=j"]
    modules = modules_of_a_run([*flags, "--nproc-per-node=2", str(script)], tmp_path)
    assert "elastic.core.agent.loop" in modules  # the agent did run
    assert imported(modules) == [], "a launch imported what it does not use"
