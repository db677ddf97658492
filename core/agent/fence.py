"""``FenceGuard``: a fenced node's workers are gone before any peer may count it lost.

The rendezvous handler fences a node whose lease ran out (``rendezvous/round/lease.py``)
or whom the job published lost. The peers' verdict comes ``STOP_MARGIN`` (1 s) after the
lease's end at the earliest, and their new round after that; a node cut off from the job
must not train on in the old world meanwhile. The agent's loop learns of the fencing when
it next asks (``lost_nodes``, every 0.5 s while it watches), but it may be busy elsewhere
for longer: in a store call bounded by the fencing itself, giving workers their shutdown
grace, deciding a failure. So the stop does not wait for it: the handler calls
``fenced(round, grace)`` from its own thread the moment it fences, and the guard sends the
round's workers' process groups SIGTERM at once and SIGKILL ``grace`` s later (a third of
the margin) from a timer. A SIGKILLed process is gone within milliseconds, so the workers
exit two thirds of the margin before the earliest verdict.

The agent tells the guard which workers run in which round (``watch``), and takes them
back before it reaps them (``release``), so the guard never signals a process group whose
leader was reaped and whose number may be reused. A fencing older than the round the
guard watches is ignored; one that came before the round's workers were handed over
stops them as they are.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence

from elastic.core.workers.child import killpg
from elastic.core.workers.process import WorkerProcess

# Grace for workers stopped because the world they train in is gone (fenced, store lost,
# stuck in a round the job has left), whatever --shutdown-timeout says: a worker blocked
# in a collective or a group's creation with a peer that is gone cannot run a Python
# signal handler (``elastic.train`` defers the preemption signal in one), so a longer
# grace only holds the agent out of the next rounds. A fencing the handler reported
# stopped them already, with its own shorter grace (``FenceGuard``), never extended.
FENCE_GRACE = 1.0

log = logging.getLogger(__name__)


class FenceGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pgids: tuple[int, ...] = ()
        self._round: int | None = None
        self._epoch = 0  # one per watch/release: a timer of an older one does nothing
        self._fenced_round: int | None = None
        self._kill_at: float | None = None  # monotonic: when the SIGKILL goes out

    def watch(self, workers: Sequence[WorkerProcess], round_: int) -> None:
        """``workers`` now run in ``round_`` (started, or handed the round in place)."""
        with self._lock:
            self._pgids = tuple(w.pid for w in workers)
            self._round = round_
            self._epoch += 1
            self._kill_at = None
            if self._fenced_round == round_:  # fenced before they were handed over
                self._stop(0.0)

    def fenced(self, round_: int, grace: float) -> None:
        """The handler fenced this node in ``round_`` (called on its thread)."""
        with self._lock:
            self._fenced_round = round_
            if round_ == self._round and self._pgids and self._kill_at is None:
                self._stop(grace)

    def release(self, timeout: float) -> float:
        """The agent stops and reaps the workers itself from now on; the grace it may
        still give them (``timeout``, or less: what is left of a fencing's grace)."""
        with self._lock:
            kill_at = self._kill_at
            self._pgids, self._round, self._kill_at = (), None, None
            self._epoch += 1
        if kill_at is None:
            return timeout
        return min(timeout, max(0.0, kill_at - time.monotonic()))

    def _stop(self, grace: float) -> None:
        """SIGTERM now, SIGKILL after ``grace``; caller holds the lock."""
        log.debug("fenced in round %s: stopping workers %s", self._round, self._pgids)
        for pgid in self._pgids:
            killpg(pgid, signal.SIGTERM)
        self._kill_at = time.monotonic() + grace
        timer = threading.Timer(grace, self._kill, (self._epoch,))
        timer.daemon = True
        timer.name = "fence-kill"
        timer.start()

    def _kill(self, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch:  # released (the agent reaps them) or watching anew
                return
            for pgid in self._pgids:
                killpg(pgid, signal.SIGKILL)
