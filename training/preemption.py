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

The notice may reach the workers too: SLURM preempts, cancels and times out a whole step,
signalling every process of it, agents and workers alike (``scancel --signal=TERM``,
``GraceTime``, ``--signal=TERM@N``). A worker that dies of it cannot save, so a worker
that listens defers the agent's preemption signal (``ELASTIC_PREEMPTION_SIGNAL``, set by
the agent) while its script keeps SIGTERM's default handler: the signal becomes a request
(``checkpoint_requested()`` is True at the next step, which the ranks' all_reduce spreads
to every rank) and the worker ends once the agent stops it after the save. It never
defers twice, nor a signal the agent sends to end it (the control file's "stopping"),
nor past ``ELASTIC_PREEMPTION_GRACE`` seconds without a save.
"""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

from elastic.core.workers.control_file import (
    CHECKPOINT_FIELD,
    ENV_PREEMPTION_GRACE,
    ENV_PREEMPTION_SIGNAL,
    LISTENING,
    SAVED,
    SAVED_PENDING,
    STOPPING_FIELD,
)
from elastic.training import control

STOP_WAIT = 120.0  # s checkpoint_saved() waits to be stopped before returning anyway

_listening = False
_noticed_at: float | None = None  # when this worker deferred the preemption signal
_notice_signal = signal.SIGTERM  # which signal that was
_notice_pending = False  # deferred, and not saved for yet


def defer_notices() -> None:
    """Turn the agent's preemption signal into a checkpoint request in this worker (main
    thread only, and only over the default handler: a script's own handler stays)."""
    signum = getattr(signal, os.environ.get(ENV_PREEMPTION_SIGNAL, ""), None)
    if not isinstance(signum, signal.Signals):
        return
    try:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _on_notice)
    except ValueError:  # not the main thread: signals stay as they are
        pass


def _on_notice(signum: int, frame: FrameType | None) -> None:
    global _noticed_at, _notice_pending, _notice_signal
    if _noticed_at is not None or control.header(STOPPING_FIELD):
        _die(signum)
    _noticed_at, _notice_pending = time.monotonic(), True
    _notice_signal = signal.Signals(signum)


def _die(signum: int) -> None:
    """End as the signal's default action would (the agent reads the signal from it)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _grace() -> float:
    try:
        return float(os.environ.get(ENV_PREEMPTION_GRACE, ""))
    except ValueError:
        return 0.0


def checkpoint_requested() -> bool:
    """True when the job asks every worker to checkpoint at this step boundary."""
    global _listening
    if not control.available():
        return False
    if not _listening:  # the agent waits for a save only from scripts that listen
        _listening = True
        control.set_mine(LISTENING, 1)
        defer_notices()
    if _noticed_at is not None and time.monotonic() - _noticed_at > _grace():
        _die(_notice_signal)  # no save in time: end as if it had not been deferred
    request = control.header(CHECKPOINT_FIELD)
    return _notice_pending or (request != 0 and request != control.mine(SAVED))


def mark_saved() -> None:
    """Say the requested checkpoint is complete on this worker (it does not wait)."""
    global _notice_pending
    # The request may reach this node's agent after our peers told us of it: until
    # then say "saved for the pending request", then name it.
    control.set_mine(SAVED, control.header(CHECKPOINT_FIELD) or SAVED_PENDING)
    _notice_pending = False


def checkpoint_saved() -> None:
    """The requested checkpoint is complete on this worker; wait to be stopped."""
    if not control.available():
        return
    deadline = time.monotonic() + STOP_WAIT
    while time.monotonic() < deadline:  # the agent stops us when the job re-forms
        mark_saved()
        time.sleep(0.05)


def _reset_for_tests() -> None:
    global _listening, _noticed_at, _notice_pending
    control.reset_for_tests()
    _listening, _noticed_at, _notice_pending = False, None, False
