"""Watching one attempt: the agent's monitor loop, until something ends the attempt.

Each ``monitor_interval``, or as soon as a worker exits, it polls the workers, asks the
plugins (``elastic_check_workers``: the stall detector answers here), reads the job-wide
flags that ``JobWatch`` caches and the rendezvous's cached list of who left, and every
``MEMBERSHIP_CHECK_INTERVAL`` asks who waits. It reads only cached job and membership
state, so a partition cannot hold it up: the handler's fencing raises instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from elastic.core.agent.job_watch import JobWatch
from elastic.core.agent.outcome import AttemptEnd, Outcome
from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.rendezvous import RendezvousConnectionError, RendezvousHandler
from elastic.core.interfaces.worker_watch import WorkerVerdict
from elastic.core.workers.exits import ExitWait
from elastic.core.workers.process import WorkerProcess

MEMBERSHIP_CHECK_INTERVAL = 0.5  # seconds between num_nodes_waiting() calls


def watch_attempt(
    workers: Sequence[WorkerProcess],
    job: JobWatch,
    *,
    interval: float,
    sleep: Callable[[float, Callable[[float], object]], None],
    handler: RendezvousHandler,
    check_plugins: Callable[[list[WorkerProcess]], WorkerVerdict | None],
    relay_checkpoint: Callable[[], bool] | None,
    regroup_wanted: Callable[[], bool] | None = None,
    checkpoint_saved: Callable[[], bool] | None = None,
) -> AttemptEnd:
    """Until the attempt ends (``job`` is stopped then); ``sleep(seconds, wait)`` runs
    ``wait`` so that a signal can interrupt it. Between checks it waits ``interval`` or
    until a worker exits, whichever is first: an exit is seen at once.
    ``regroup_wanted``: a worker whose group broke asks the job to re-form
    (``core/agent/regroup.py``). ``relay_checkpoint`` raises a preemption notice's
    request locally and says whether this node's save is counted; ``checkpoint_saved``
    whether its workers saved already (they hear of a request from their peers first)."""
    exits = ExitWait(w.pid for w in workers)
    try:
        next_membership = time.monotonic() + MEMBERSHIP_CHECK_INTERVAL
        while True:
            sleep(interval, exits.wait)
            now = time.time()
            codes = {w.local_rank: w.poll() for w in workers}
            failed = {r: (c, now) for r, c in codes.items() if c is not None and c != 0}
            if failed:
                return AttemptEnd(Outcome.FAILED, failed)
            if all(c == 0 for c in codes.values()):
                return AttemptEnd(Outcome.SUCCEEDED)
            verdict = check_plugins([w for w in workers if codes[w.local_rank] is None])
            if verdict is not None:
                if verdict.failed:
                    return AttemptEnd(Outcome.FAILED, dict(verdict.failed))
                return AttemptEnd(Outcome.PEER_FAILED)
            job.refresh()
            if job.error is not None:
                raise RendezvousConnectionError(str(job.error))
            if job.failed:
                return AttemptEnd(Outcome.JOB_FAILED)
            if job.peer_failed:
                return AttemptEnd(Outcome.PEER_FAILED)
            if job.finished:  # the job ended in the last round while ours started
                return AttemptEnd(Outcome.SUCCEEDED)
            if regroup_wanted is not None and regroup_wanted():
                return AttemptEnd(Outcome.MEMBERSHIP)
            saved = checkpoint_saved is not None and checkpoint_saved()
            if (job.checkpoint_requested or saved) and relay_checkpoint is not None:
                # A node got a preemption notice. It leaves the moment every node's save
                # is counted: from then on read the round's lost list each interval
                # rather than wait for the handler's next tick to bring it.
                if store_call(relay_checkpoint) and store_call(handler.membership_changed):
                    return AttemptEnd(Outcome.LOST_NODE)
            # Answered from the handler's cache (its contract): every interval, so a
            # departure the handler has read is acted on at once. Raises when fenced.
            if store_call(handler.lost_nodes):
                return AttemptEnd(Outcome.LOST_NODE)
            mono = time.monotonic()
            if mono >= next_membership:
                next_membership = mono + MEMBERSHIP_CHECK_INTERVAL
                if store_call(handler.num_nodes_waiting) > 0:
                    return AttemptEnd(Outcome.MEMBERSHIP)
    finally:
        exits.close()
        job.stop()
