"""How the agent sees a worker make progress, from the most precise source to the least.

1. **Heartbeats** (``elastic.heartbeat()``, called by ``elastic.train`` every step): the
   agent creates one small file per worker and names it in ``ELASTIC_PROGRESS_FILE``;
   the worker maps it and writes ``(beats so far, unix time)`` into it with one
   ``struct.pack_into`` per call, the agent maps it too and sees the count change. No
   system call per beat, so millions of calls per second cost nothing measurable.
2. **FileTimer requests** (torch's ``FileTimerClient``): every acquire or release a
   worker sends counts as progress, and a worker holding an armed timer is judged by
   that timer, not by the stall timeout (``core/watchdog/file_timer.py``).
3. **CPU time**, for a script with none of the above: the user+system CPU seconds of
   the worker's process tree (``/proc/<pid>/stat`` of the worker and its descendants,
   plus what its reaped children used) and the time its threads waited for a CPU
   (``/proc/<pid>/task/*/schedstat``), sampled every ``CPU_SAMPLE`` seconds. A sample in
   which the tree ran or wanted to run for at least ``CPU_BUSY`` of one core is
   progress. A process blocked in ``sleep``, a lock, a socket read or a gloo collective
   scores ~0 (a stray clock tick now and then), a busy one ~100 % even on a machine so
   loaded that it gets little CPU, so one long call that computes is never mistaken for
   a hang. Once a worker has sent a heartbeat, only heartbeats and timer
   requests count for it: they say "a step finished", CPU only says "something ran"
   (a spinning data loader thread, NCCL's busy wait).

This module runs in the agent and never imports torch. The worker side of (1) is
``elastic.training.heartbeat``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from dataclasses import dataclass, field

ENV_PROGRESS = "ELASTIC_PROGRESS_FILE"
LAYOUT = struct.Struct("<Qd")  # heartbeats so far, unix time of the latest one
CPU_SAMPLE = 0.5  # seconds between CPU-time samples of a worker's process tree
CPU_BUSY = 0.05  # fraction of one core in a sample that counts as progress
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ProgressFile:
    """The agent's end of one worker's heartbeat file (created zeroed, mapped read-only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(LAYOUT.size))
            self._map: mmap.mmap | None = mmap.mmap(fd, LAYOUT.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def read(self) -> tuple[int, float]:
        """(heartbeats so far, unix time of the latest); (0, 0.0) before the first."""
        if self._map is None:
            return 0, 0.0
        count, when = LAYOUT.unpack_from(self._map, 0)
        return int(count), float(when)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _proc_usage(pid: int) -> tuple[float, float, list[int]] | None:
    """(CPU seconds of ``pid`` incl. its reaped children, seconds its threads waited for
    a CPU, its live children), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 (state): utime, stime, cutime, cstime are fields 14-17.
    cpu = sum(int(v) for v in fields[11:15]) / _TICK
    wait_ns = 0
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        try:  # "on-CPU ns, run-queue wait ns, timeslices"
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                wait_ns += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
        try:  # children forked by any thread of the process
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return cpu, wait_ns / 1e9, children


def tree_usage(pid: int) -> tuple[float, float] | None:
    """(CPU seconds, CPU-wait seconds) of ``pid`` and every live descendant, or None."""
    first = _proc_usage(pid)
    if first is None:
        return None
    cpu, wait, todo = first
    seen = {pid}
    while todo:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        got = _proc_usage(child)
        if got is not None:
            cpu, wait = cpu + got[0], wait + got[1]
            todo += got[2]
    return cpu, wait


@dataclass
class WorkerProgress:
    """What the agent knows of one worker's progress in the current attempt."""

    local_rank: int
    rank: int
    pid: int
    started: float  # monotonic time the tracking began (the worker's start)
    file: ProgressFile | None = None
    last_progress: float = 0.0  # monotonic
    last_progress_wall: float = 0.0  # unix time (worker's own for heartbeats)
    source: str = "start"  # what showed the latest progress: heartbeat, timer, cpu, start
    beats: int = 0
    cpu: float = 0.0
    _cpu_base: float | None = None
    _cpu_at: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.last_progress = self.started
        self.last_progress_wall = time.time()

    def note(self, source: str, mono: float | None = None, wall: float | None = None) -> None:
        self.last_progress = time.monotonic() if mono is None else mono
        self.last_progress_wall = time.time() if wall is None else wall
        self.source = source

    def sample(self, mono: float) -> None:
        """Read the heartbeat file (every call) and the CPU time (every CPU_SAMPLE s)."""
        if self.file is not None:
            count, when = self.file.read()
            if count != self.beats:
                self.beats = count
                self.note("heartbeat", mono, when or None)
        if self._cpu_base is not None and mono - self._cpu_at < CPU_SAMPLE:
            return
        usage = tree_usage(self.pid)
        if usage is None:
            return
        busy = usage[0] + usage[1]  # ran, or wanted to run (a loaded machine)
        base, since = self._cpu_base, self._cpu_at
        self._cpu_base, self._cpu_at, self.cpu = busy, mono, usage[0]
        if base is None or self.beats:
            return  # heartbeats, once seen, are the only judge of this worker
        ran = busy - base
        if ran >= CPU_BUSY * (mono - since):
            # A sample on time is dated when taken. A late one (the agent was starved for
            # seconds) may hold the last work before a hang: dated at the sample, that work
            # would push the hang's detection back by the whole delay, so it is dated
            # where the work may have ended at the earliest (all of it at the window's
            # start), never before one sample's length. A tree still busy shows it again
            # in the next sample, CPU_SAMPLE s later.
            dated = min(mono, since + max(ran, CPU_SAMPLE))
            self.note("cpu", dated, time.time() - (mono - dated))

    def idle(self, mono: float) -> float:
        """Seconds since the latest progress."""
        return max(mono - self.last_progress, 0.0)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
