"""``elastic.heartbeat()``: tell the agent this worker made progress. Call it once per
step (``elastic.train`` does it for you).

Under ``elastic run`` the agent names a small file in ``ELASTIC_PROGRESS_FILE``; the first
call maps it and every call writes ``(calls so far, unix time)`` into the mapping: no
system call, no lock, a few hundred nanoseconds. Outside ``elastic run`` (the variable is
unset or unusable) it is a no-op. The agent's ``--stall-timeout`` judges a worker that
has called it by its heartbeats alone (``elastic.core.watchdog.beats``).
"""

from __future__ import annotations

import mmap
import time

from elastic.core.watchdog.beats import ENV_PROGRESS, LAYOUT
from elastic.training.agent_file import map_from_env

_pack = LAYOUT.pack_into
_now = time.time
_map: mmap.mmap | None = None
_count = 0
_off = False


def _open() -> bool:
    """Map the agent's file; False (and a no-op from then on) when there is none."""
    global _map, _count, _off
    try:
        _map = map_from_env(ENV_PROGRESS, LAYOUT.size)
    except (OSError, ValueError):
        _off = True
        return False
    _count = LAYOUT.unpack_from(_map, 0)[0]  # a forked child goes on counting
    return True


def heartbeat() -> None:
    """Record one unit of progress (one training step) for the agent's stall watchdog."""
    global _count
    if _map is None and (_off or not _open()):
        return
    _count += 1
    _pack(_map, 0, _count, _now())  # type: ignore[arg-type]


class WaitBeat:
    """Heartbeats while a worker waits for its agent or its peers (a wait is not a stall),
    called on every poll of the wait: at most one a second."""

    def __init__(self) -> None:
        self._next = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            heartbeat()
            self._next = now + 1.0


def _reset_for_tests() -> None:
    """Forget the mapping (a test changes ``ELASTIC_PROGRESS_FILE``)."""
    global _map, _count, _off
    if _map is not None:
        _map.close()
    _map, _count, _off = None, 0, False
