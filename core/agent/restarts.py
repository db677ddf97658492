"""The job-wide restart budget: one claim per failed round, and giving up for good.

Every node reads and writes the same keys (``interfaces/job_keys``), so all agents agree
on ``TORCHELASTIC_RESTART_COUNT`` and on when the budget is spent. Counters and
compare-and-set only: O(1) per node and event.
"""

from __future__ import annotations

import contextlib

from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.job_keys import CLAIM_KEY, FAILED_KEY, RESTARTS_KEY
from elastic.core.interfaces.rendezvous import RendezvousError, RendezvousHandler
from elastic.core.interfaces.store import Store


def claim_restart(store: Store, round_: int, node_id: str) -> int:
    """Spend one restart of the job-wide budget for a failed round; the restarts so far.

    Every node whose workers failed in round R races for the one claim of R, so a failure
    seen by several nodes at once costs the job a single restart.
    """
    won = store_call(store.compare_set, CLAIM_KEY.format(round_), "", node_id)
    if won == node_id.encode():
        return int(store_call(store.add, RESTARTS_KEY, 1))
    return int(store_call(store.add, RESTARTS_KEY, 0))


def restarts_used(store: Store) -> int:
    """The restarts spent so far (``TORCHELASTIC_RESTART_COUNT`` of the next attempt)."""
    return int(store_call(store.add, RESTARTS_KEY, 0))


def job_failed(store: Store | None) -> bool:
    """Whether a node gave up for the whole job."""
    return store is not None and bool(store_call(store.check, [FAILED_KEY]))


def give_up(store: Store, handler: RendezvousHandler) -> None:
    """Fail the whole job: every agent's watch sees the flag; no round forms again."""
    store_call(store.set, FAILED_KEY, "1")
    with contextlib.suppress(RendezvousError):
        handler.set_closed()
