"""What a new worker process does before it runs anything (die with the agent, keep to
its CPUs), and signalling a worker's process group: shared by ``process`` (workers) and
``spare`` (interpreters started ahead for them)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, resolved once in the agent: a forked child must not dlopen."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_PRCTL = _load_prctl()


def die_with_parent(parent_pid: int | None) -> None:
    """Ask for SIGKILL when the parent dies, then close the race in which it died first.

    If the agent died between our fork and the prctl, we are already an orphan and the
    death signal will never come, so we end ourselves. ``parent_pid`` None: the parent is
    not the agent but a forkserver (which exits when the agent dies, and its death then
    kills us); we only check that we have not been orphaned already.
    """
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    ppid = os.getppid()
    if (parent_pid is not None and ppid != parent_pid) or ppid == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def start_child(parent_pid: int | None, cpus: set[int] | None) -> None:
    """In a new worker, before it runs anything: die with the agent, and keep to
    ``cpus`` (``--numa-binding``) when given. Only the child is bound, never the agent."""
    die_with_parent(parent_pid)
    if cpus:
        os.sched_setaffinity(0, cpus)


def killpg(pgid: int, sig: int) -> None:
    """Signal a worker's process group; a group that is already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
