"""``JobWatch``: the job-wide flags of one round, read in the background."""

from __future__ import annotations

import threading

from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.job_keys import CLAIM_KEY, FAILED_KEY, PREEMPT_KEY
from elastic.core.interfaces.rendezvous import RendezvousError, RendezvousStoreGoneError
from elastic.core.interfaces.store import Store


class JobWatch:
    """The job-wide flags of one round (another node spent the budget; another node's
    workers failed), read every ``interval`` s by a daemon thread, so the agent's monitor
    loop never blocks on a store that stopped answering (a partition): it reads cached
    values and learns of the partition through the handler's fencing instead."""

    def __init__(self, store: Store, round_: int, interval: float = 1.0) -> None:
        self._store = store
        self._claim = CLAIM_KEY.format(round_)
        self._preempt = PREEMPT_KEY.format(round_)
        self._interval = interval
        self._stop = threading.Event()
        self.failed = False  # agent/failed is set: the job is over
        self.peer_failed = False  # a node claimed this round's restart
        self.checkpoint_requested = False  # a node got a preemption notice this round
        self.error: Exception | None = None  # the store said it is gone
        self._thread = threading.Thread(target=self._run, name="job-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:  # one request per interval: every node of the job does this
                keys = [FAILED_KEY, self._claim, self._preempt]
                failed, claim, preempt = store_call(self._store.multi_get, keys)
                self.failed, self.peer_failed = bool(failed), bool(claim)
                self.checkpoint_requested = self.checkpoint_requested or bool(preempt)
            except RendezvousStoreGoneError as exc:
                self.error = exc
                return
            except RendezvousError:
                continue  # unreachable for now: the handler's fencing decides

    def stop(self) -> None:
        self._stop.set()
