"""Fixtures shared by every test module: free ports, running the CLI for real, and
making sure no process a test started outlives it. Ports and waits come from
``elastic.testing`` (``free_port``, ``wait_until``), shared with the bench scripts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic.core.interfaces.spec import WorkerSpec
from elastic.core.tcpstore import wire
from elastic.testing.cluster import cluster_factory  # noqa: F401  (the fixture, for every test)
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until  # noqa: F401  (for the test modules)

REPO = Path(__file__).resolve().parent.parent

# Under srun, ``elastic run`` takes the step's nodes from SLURM_* (cli/slurm.py): a suite run
# inside a SLURM job must not turn every test's launch into a job across the allocation.
# Tests that want a SLURM environment give it explicitly.
for _name in [n for n in os.environ if n.startswith("SLURM_")]:
    del os.environ[_name]


@pytest.fixture
def port() -> int:
    return free_port()


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def elastic_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic", *args]


class Processes:
    """Starts real subprocesses (each its own session) and kills what is left at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, cmd: list[str], **kwargs: object) -> subprocess.Popen[str]:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        kwargs.setdefault("env", cli_env())
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def elastic(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        return self.start(elastic_cmd(*args), **kwargs)

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


@pytest.fixture
def procs() -> Iterator[Processes]:
    p = Processes()
    yield p
    p.cleanup()


def run_elastic(
    *args: str,
    timeout: float = 90,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m elastic ARGS`` to completion and return what it printed."""
    return subprocess.run(
        elastic_cmd(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(env),
        cwd=cwd,
    )


def write_script(tmp_path: Path, name: str, body: str) -> str:
    """A worker script from an indented literal; returns its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def make_spec(handler: Any, args: tuple[str, ...], nproc: int = 2, **kwargs: Any) -> WorkerSpec:
    """A WorkerSpec with test-friendly defaults: fast monitoring, short grace."""
    kwargs.setdefault("monitor_interval", 0.05)
    kwargs.setdefault("shutdown_timeout", 2.0)
    return WorkerSpec(
        role=kwargs.pop("role", "default"),
        local_world_size=nproc,
        entrypoint=kwargs.pop("entrypoint", sys.executable),
        args=args,
        rdzv_handler=handler,
        **kwargs,
    )


def make_distribution(root: Path, name: str, entry_points: str, modules: dict[str, str]) -> Path:
    """A throwaway installed distribution exactly as pip leaves one (``.dist-info`` with
    METADATA and entry_points.txt, plus its modules) under ``root``; returns ``root``,
    the directory to put on ``sys.path`` or ``PYTHONPATH``."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie, or one the kernel is still tearing down (X), is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def raw(port: int) -> socket.socket:
    """A bare connection to a loopback store server (for misbehaving-peer tests)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def handshaken(port: int) -> socket.socket:
    """A bare connection past TCPStore's ping handshake."""
    sock = raw(port)
    sock.sendall(wire.handshake(7))
    assert sock.recv(4) == wire.U32.pack(7)
    return sock
