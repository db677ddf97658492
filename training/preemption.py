"""The worker's side of a coordinated checkpoint on preemption
(``elastic.core.agent.checkpoint_on_notice``).

A DDP script adds three lines to its step loop::

    flag = torch.tensor([int(elastic.checkpoint_requested())])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)      # every rank saves at the same step
    if flag.item(): save(step); dist.barrier(); elastic.checkpoint_saved()

``checkpoint_requested()`` reads one word of shared memory: safe to call every step, and
False outside ``elastic run``. ``checkpoint_saved()`` tells the agent the save is complete
and waits for the agent to stop this worker (a node is leaving and the job re-forms from
that checkpoint, so no step runs past it); outside ``elastic run`` it returns at once.
``elastic.train`` does all of this by itself.
"""

from __future__ import annotations

import mmap
import os
import time

from elastic.core.workers.control_file import ENV_CONTROL, HEADER, SAVED_PENDING, SLOT, slot_offset

STOP_WAIT = 120.0  # s checkpoint_saved() waits to be stopped before returning anyway

_map: mmap.mmap | None = None
_slot = 0
_off = False
_listening = False


def _open() -> bool:
    global _map, _slot, _off
    path = os.environ.get(ENV_CONTROL)
    try:
        if not path:
            raise OSError("not under elastic run")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        fd = os.open(path, os.O_RDWR)
        try:
            _map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        _slot = slot_offset(local_rank)
        if _slot + SLOT.size > len(_map):
            raise ValueError(f"LOCAL_RANK {local_rank} has no slot in {path}")
    except (OSError, ValueError):
        _off = True
        return False
    return True


def _mapped() -> mmap.mmap | None:
    if _map is None and (_off or not _open()):
        return None
    return _map


def checkpoint_requested() -> bool:
    """True when the job asks every worker to checkpoint at this step boundary."""
    global _listening
    m = _mapped()
    if m is None:
        return False
    if not _listening:  # the agent waits for a save only from scripts that listen
        _listening = True
        SLOT.pack_into(m, _slot, 1, SLOT.unpack_from(m, _slot)[1])
    (request,) = HEADER.unpack_from(m, 0)
    return request != 0 and request != SLOT.unpack_from(m, _slot)[1]


def checkpoint_saved() -> None:
    """The requested checkpoint is complete on this worker; wait to be stopped."""
    m = _mapped()
    if m is None:
        return
    deadline = time.monotonic() + STOP_WAIT
    while time.monotonic() < deadline:  # the agent stops us when the job re-forms
        # The request may reach this node's agent after our peers told us of it: until
        # then say "saved for the pending request", then name it.
        (request,) = HEADER.unpack_from(m, 0)
        SLOT.pack_into(m, _slot, 1, request or SAVED_PENDING)
        time.sleep(0.05)


def _reset_for_tests() -> None:
    global _map, _off, _listening
    if _map is not None:
        _map.close()
    _map, _off, _listening = None, False, False
