"""``elastic.init_process_group``: the process group for a worker started by elastic."""

from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import sys
import traceback
from typing import Any

from elastic.core.workers.control_file import CONNECTING, MEETING, READY
from elastic.training import bounded, control, rounds, sever

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# How the default group was made here, so a regroup re-creates it alike.
_made: dict[str, Any] = {}
_exit_hook: list[bool] = []  # registered once per process
# Groups left with a collective given up on (``bounded.wait_work``), and those works: the
# group's destructor joins its gloo threads, one of which still waits for a peer that is
# gone, until gloo's timeout. Kept here until those works end, so none is destroyed while
# it waits.
_parked: list[tuple[Any, list[Any]]] = []


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    backend: str | None = None,
    timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> str:
    """Initialize ``torch.distributed`` from the launcher's environment; returns the backend.

    ``backend`` defaults to nccl when CUDA is available, else gloo. With nccl the current
    device is set to ``LOCAL_RANK`` first, so each worker gets its own GPU. ``timeout``
    (a timedelta or seconds) bounds each collective: 5 minutes by default rather than
    torch's 10-30, because a worker stuck on a dead peer only delays the restart that
    brings the job back. Calling it again once initialized is a no-op.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return str(dist.get_backend())
    missing = [name for name in _REQUIRED if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_process_group: {', '.join(missing)} not set; start this script with "
            "`elastic run` (or torchrun)"
        )
    backend = backend or default_backend()
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    # torch.distributed.nn.functional binds ``group.WORLD`` as its functions' default
    # ``group`` when it is imported: imported while a group exists, it holds that group
    # for good, and destroy_process_group leaves it alive (its gloo threads, rank 0's
    # store). torch._dynamo imports it, and the first optimizer a script creates imports
    # torch._dynamo (torch 2.13). Such a group is torn down during interpreter
    # finalization, where a gloo thread taking the GIL aborts the worker (SIGABRT,
    # "terminate called without an active exception") after a successful run. Imported
    # before any group exists, the defaults are None. Dynamo rather than that one module:
    # whatever else its import chain binds is bound before the group exists too, and a
    # script pays that import for its first optimizer anyway.
    import torch._dynamo  # noqa: F401

    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Workers kept from the last round wait for this before they stop to join us.
    control.set_mine(READY, MEETING)
    store, before = None, sever.Sockets()
    while control.available():
        # The job re-formed while this worker started (or waited to meet): its agent
        # hands it the new round instead of restarting it (``core/agent/in_place.py``).
        rounds.take_pending()
        before = sever.sockets()
        try:
            # The round's ranks meet at its store before gloo's connect, which waits for
            # every rank in C++: a rank of this round that is gone holds us in Python,
            # where a newer round handed over ends the wait.
            store = bounded.meet(limit=timeout.total_seconds())
        except bounded.RoundMoved:
            continue  # a newer round came: take it
        # Every rank met: each connects now, and one that went on to a newer round would
        # leave the others waiting in gloo. A newer round is taken at the first step
        # boundary instead (``membership_changed``).
        control.set_mine(READY, CONNECTING)
        break
    dist.init_process_group(backend=backend, init_method="env://", timeout=timeout, **kwargs)
    del store  # the group's own store shares its server now
    sever.note(before)
    _made.update(backend=backend, timeout=timeout, kwargs=kwargs)
    _leave_at_exit()
    return backend


def leave_group() -> None:
    """Tear the default process group down, even when a peer died under it.

    gloo's group is destroyed; one with a collective given up on (``bounded``) is only
    dropped from torch's registry and kept (``_parked``) until that collective ends, as
    its destroy would wait for it. NCCL communicators blocked on (or poisoned by) a dead peer
    would hang a plain destroy, so they are aborted first (``_abort_process_group``,
    torch 2.13). Tested on CPU (gloo) only."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    _release_failed_call()
    backend = str(dist.get_backend())
    _made.setdefault("backend", backend)  # a group the script made itself
    if "nccl" in backend:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
        if not dist.is_initialized():
            return
    if bounded.abandoned:
        _parked.append((dist.group.WORLD, list(bounded.abandoned)))
        bounded.abandoned.clear()
        _leave_at_exit()  # a group the script made itself: kept past exit too
    dist.destroy_process_group()
    _parked[:] = [(group, works) for group, works in _parked if not _ended(works)]


def _ended(works: list[Any]) -> bool:
    return all(work.is_completed() for work in works)


def _keep_parked_past_exit() -> None:
    """A parked group whose work still waits is never destroyed: at exit, where its
    destructor would wait out gloo's timeout (or abort the worker in finalization), the
    process ends with it alive."""
    for group, works in _parked:
        if not _ended(works):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _release_failed_call() -> None:
    """Drop what the exception being handled, or the one the script ended with, holds of
    the group, if any.

    A collective that raised (a peer died) leaves its frames on the exception's traceback,
    and torch's ``all_reduce`` frame holds the group and its work. While the exception
    lives (the caller is still in its ``except`` block, waiting for the next round), the
    destroyed group is never freed, so its gloo connections stay open: a peer blocked in
    the same collective with this rank, not with the dead one, never sees a closed
    connection and waits out the collective timeout, far past the agent's bound for a
    step boundary, and the agent restarts it. Clearing those frames' locals (frames
    still running are left alone) frees the group with the destroy.

    At exit (``_leave_at_exit``) it is the exception that ended the script, kept in
    ``sys.last_value`` (``sys.last_exc`` from 3.12): a done worker whose last barrier
    failed because a peer was stopped or its agent went away. Held by it, the group
    would be torn down during finalization, where gloo's threads abort the worker."""
    seen: set[int] = set()
    for exc in (
        sys.exc_info()[1],
        getattr(sys, "last_exc", None),
        getattr(sys, "last_value", None),
    ):
        while isinstance(exc, BaseException) and id(exc) not in seen:
            seen.add(id(exc))
            traceback.clear_frames(exc.__traceback__)
            exc = exc.__cause__ or exc.__context__


def rejoin_group() -> str:
    """Create the default group again from the (updated) environment, as it was made.

    The round's ranks first meet in Python (``bounded.meet``): gloo's connect waits for
    every rank, and one that is gone would hold the others there for the whole timeout.
    ``RoundMoved`` when the agent hands over a newer round before they all came."""
    import torch.distributed as dist

    backend = _made.get("backend") or default_backend()
    timeout = _made.get("timeout", DEFAULT_TIMEOUT)
    before = sever.sockets()
    store = bounded.meet(limit=timeout.total_seconds())
    dist.init_process_group(
        backend=backend, init_method="env://", timeout=timeout, **_made.get("kwargs", {})
    )
    del store  # the group's own store shares its server now
    sever.note(before)
    _leave_at_exit()
    return backend


def _leave_at_exit() -> None:
    """Tear the default group down before the interpreter finalizes, once per process.

    A group still alive at exit (a script that ends without destroy_process_group) is
    otherwise destroyed during finalization, where its gloo threads may need the GIL:
    that aborts the worker (SIGABRT, "terminate called without an active exception")
    after a successful run, seen in workers that regrouped in place. atexit handlers run
    while every thread can still take the GIL."""
    if not _exit_hook:
        _exit_hook.append(True)
        atexit.register(_keep_parked_past_exit)  # atexit runs handlers last in, first out
        atexit.register(leave_group)
