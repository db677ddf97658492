"""The job-wide restart budget: one claim per failed round, and giving up for good.

Every node reads and writes the same keys (``interfaces/job_keys``), so all agents agree
on ``TORCHELASTIC_RESTART_COUNT`` and on when the budget is spent. The budget is one
record (restarts used, rounds charged) changed by one ``compare_set``: a round is claimed
and charged in the same write, so a claimer that dies cannot leave a claim uncharged, and
two claimers of one round charge it once. With a job token the record is signed like
every other (``rendezvous/round/signing.py``).
"""

from __future__ import annotations

import contextlib

from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.job_keys import BUDGET_KEY, FAILED_KEY, budget_record, parse_budget
from elastic.core.interfaces.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousStateError,
)
from elastic.core.interfaces.store import Store

_CLAIM_ATTEMPTS = 1000  # compare_set races lost before giving up (each one a real write)


def _budget(store: Store) -> tuple[bytes, int, list[int]]:
    (raw,) = store_call(store.multi_get, [BUDGET_KEY])
    used, rounds = parse_budget(bytes(raw))
    return bytes(raw), used, rounds


def claim_restart(store: Store, round_: int, node_id: str) -> int:
    """Spend one restart of the job-wide budget for a failed round; the restarts so far.

    Every node whose workers failed in round R races for the one claim of R, so a failure
    seen by several nodes at once costs the job a single restart. ``node_id`` is kept for
    callers; the record does not need it.
    """
    del node_id
    for _ in range(_CLAIM_ATTEMPTS):
        raw, used, rounds = _budget(store)
        if round_ in rounds:
            return used
        desired = budget_record(used + 1, [*rounds, round_])
        if bytes(store_call(store.compare_set, BUDGET_KEY, raw, desired)) == desired:
            return used + 1
    raise RendezvousStateError(f"could not charge a restart to {BUDGET_KEY!r}: too much contention")


def restarts_used(store: Store) -> int:
    """The restarts spent so far (``TORCHELASTIC_RESTART_COUNT`` of the next attempt)."""
    return _budget(store)[1]


def restart_claimed(store: Store, round_: int) -> bool:
    """Whether a node's failure in ``round_`` was charged (its workers failed)."""
    return round_ in _budget(store)[2]


def job_failed(store: Store | None) -> bool:
    """Whether a node gave up for the whole job."""
    return store is not None and bool(store_call(store.check, [FAILED_KEY]))


def give_up(store: Store, handler: RendezvousHandler) -> None:
    """Fail the whole job: every agent's watch sees the flag; no round forms again."""
    store_call(store.set, FAILED_KEY, "1")
    with contextlib.suppress(RendezvousError):
        handler.set_closed()
