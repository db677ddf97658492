"""The launchers a test or bench starts, and what ``/proc`` says about the processes.

Launched jobs put their workers in sessions of their own, so stopping a job means finding
every process below its launcher (``descendants``) and killing each one's process group
(``kill_tree``). The readings (CPU time, peak RSS, free memory) come from ``/proc`` and are
``None`` once a process is gone, so a poller never has to race its exit. A test starts
its processes through ``Processes``, which kills what is left at teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from elastic.harness.commands import cli_env, elastic_cmd


def launcher_cmd(impl: str, python: str | Path | None = None) -> list[str]:
    """``python -m`` form of launcher ``impl``: ``"ours"`` (``elastic run``) or
    ``"torchrun"`` (``torch.distributed.run``), with ``python`` (default: this
    interpreter)."""
    python = str(python or sys.executable)
    if impl == "ours":
        return [python, "-m", "elastic", "run"]
    if impl == "torchrun":
        return [python, "-m", "torch.distributed.run"]
    raise ValueError(f"launcher must be 'ours' or 'torchrun', got {impl!r}")


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


def sigkill_group(pid: int) -> None:
    """SIGKILL ``pid``'s process group, or ``pid`` alone when it leads none; a process
    that is gone (or not ours) is skipped."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant's process group."""
    for target in [pid, *descendants(pid)]:
        sigkill_group(target)


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
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmHWM``: peak RSS); None once gone or
    a zombie (its memory map is freed, the field absent)."""
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


def raise_nofile(wanted: int) -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` towards ``wanted`` (up to the hard limit); the
    children inherit it. Returns the (soft, hard) limits now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


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
