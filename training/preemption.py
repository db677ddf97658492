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

import time

from elastic.core.workers.control_file import CHECKPOINT_FIELD, LISTENING, SAVED, SAVED_PENDING
from elastic.training import control

STOP_WAIT = 120.0  # s checkpoint_saved() waits to be stopped before returning anyway

_listening = False


def checkpoint_requested() -> bool:
    """True when the job asks every worker to checkpoint at this step boundary."""
    global _listening
    if not control.available():
        return False
    if not _listening:  # the agent waits for a save only from scripts that listen
        _listening = True
        control.set_mine(LISTENING, 1)
    request = control.header(CHECKPOINT_FIELD)
    return request != 0 and request != control.mine(SAVED)


def mark_saved() -> None:
    """Say the requested checkpoint is complete on this worker (it does not wait)."""
    # The request may reach this node's agent after our peers told us of it: until
    # then say "saved for the pending request", then name it.
    control.set_mine(SAVED, control.header(CHECKPOINT_FIELD) or SAVED_PENDING)


def checkpoint_saved() -> None:
    """The requested checkpoint is complete on this worker; wait to be stopped."""
    if not control.available():
        return
    deadline = time.monotonic() + STOP_WAIT
    while time.monotonic() < deadline:  # the agent stops us when the job re-forms
        mark_saved()
        time.sleep(0.05)


def _reset_for_tests() -> None:
    global _listening
    control.reset_for_tests()
    _listening = False
