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


class JobWatch:
    """The job-wide flags of one round (another node spent the budget; another node's
    workers failed; a node got a preemption notice), kept fresh in the background, so
    the agent's monitor loop never blocks on a store that stopped answering (a
    partition): it reads cached values and learns of the partition through the
    handler's fencing instead.

    When the rendezvous handler reads in the background anyway (``watch_keys``: the
    shared round's monitor tick), the keys ride on that read, which costs the store
    nothing, and ``refresh`` takes them from its cache; otherwise a daemon thread reads
    them itself, one request every ``interval`` s."""

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
        self._interval = interval
        self._cached = handler.watch_keys(self._keys) if handler is not None else None
        self._stop = threading.Event()
        self.failed = False  # agent/failed is set: the job is over
        self.peer_failed = False  # a node claimed this round's restart
        self.checkpoint_requested = False  # a node got a preemption notice this round
        self.finished = False  # kept workers finished the job while this round formed
        self.error: Exception | None = None  # the store said it is gone
        # Reading the handler's cache costs nothing: ``refresh`` does it on the agent's
        # own thread, each time it looks. Only reading the store needs a thread.
        if self._cached is None:
            self._thread = threading.Thread(target=self._run, name="job-watch", daemon=True)
            self._thread.start()

    def refresh(self) -> None:
        """Take the flags from the handler's cache, when it keeps them (a no-op otherwise:
        the thread reads the store every interval)."""
        if self._cached is None:
            return
        values = self._cached()
        if values is not None and len(values) == len(self._keys):
            self._take(values)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:  # one request per interval: every node of the job does this
                values = store_call(self._store.multi_get, self._keys)
            except RendezvousStoreGoneError as exc:
                self.error = exc
                return
            except RendezvousError:
                continue  # unreachable for now: the handler's fencing decides
            self._take(values)

    def _take(self, values: list[bytes]) -> None:
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
