"""``JobWatch``: the job-wide flags of one round, read in the background."""

from __future__ import annotations

import threading

from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.job_keys import (
    BUDGET_KEY,
    FAILED_KEY,
    FINISHED_KEY,
    PREEMPT_KEY,
    parse_budget,
)
from elastic.core.interfaces.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousStoreGoneError,
)
from elastic.core.interfaces.store import Store

CACHE_POLL = 0.2  # s between looks at the handler's cached values


class JobWatch:
    """The job-wide flags of one round (another node spent the budget; another node's
    workers failed; a node got a preemption notice), refreshed every ``interval`` s by a
    daemon thread, so the agent's monitor loop never blocks on a store that stopped
    answering (a partition): it reads cached values and learns of the partition through
    the handler's fencing instead.

    When the rendezvous handler reads in the background anyway (``watch_keys``: the
    shared round's monitor tick), the keys ride on that read and this costs the store
    nothing; otherwise the thread reads them itself, one request per interval."""

    def __init__(
        self,
        store: Store,
        round_: int,
        interval: float = 1.0,
        handler: RendezvousHandler | None = None,
    ) -> None:
        self._store = store
        self._round = round_
        self._keys = [
            FAILED_KEY,
            BUDGET_KEY,
            PREEMPT_KEY.format(round_),
            FINISHED_KEY.format(round_),
        ]
        self._handler = handler
        self._cached = handler.watch_keys(self._keys) if handler is not None else None
        # Reading a cache costs nothing: look often, so a flag is seen within a tick.
        self._interval = min(interval, CACHE_POLL) if self._cached is not None else interval
        self._stop = threading.Event()
        self.failed = False  # agent/failed is set: the job is over
        self.peer_failed = False  # a node claimed this round's restart
        self.checkpoint_requested = False  # a node got a preemption notice this round
        self.finished = False  # kept workers finished the job while this round formed
        self.error: Exception | None = None  # the store said it is gone
        self._thread = threading.Thread(target=self._run, name="job-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if self._cached is not None:
                values = self._cached()
                if values is None or len(values) != len(self._keys):
                    continue  # not read yet
            else:
                try:  # one request per interval: every node of the job does this
                    values = store_call(self._store.multi_get, self._keys)
                except RendezvousStoreGoneError as exc:
                    self.error = exc
                    return
                except RendezvousError:
                    continue  # unreachable for now: the handler's fencing decides
            failed, budget, preempt, finished = values
            self.failed = bool(failed)
            try:
                self.peer_failed = self._round in parse_budget(budget)[1]
            except RendezvousError:
                pass  # not a budget record (anyone may write one): no claim seen
            self.checkpoint_requested = self.checkpoint_requested or bool(preempt)
            self.finished = self.finished or bool(finished)

    def stop(self) -> None:
        self._stop.set()
        if self._cached is not None and self._handler is not None:
            self._handler.watch_keys([])
