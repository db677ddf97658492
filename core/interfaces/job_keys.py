"""The job-wide keys every agent reads and writes in the rendezvous store, and how
``elastic status`` reads them back.

The backend namespaces the store by run id, so these names are the same for every job.
They live below the agent because the rendezvous backends' ``describe`` reads them too.
"""

from __future__ import annotations

from typing import Any

from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.rendezvous import RendezvousStateError
from elastic.core.interfaces.store import Store

RESTARTS_KEY = "agent/restarts"  # restarts spent so far (an atomic counter)
FAILED_KEY = "agent/failed"  # set once the job failed for good
CLAIM_KEY = "agent/restart_claim/{}"  # one restart per failed round, compare_set
BARRIER_KEY = "agent/exit_barrier/{}"  # nodes that finished the round
PREEMPT_KEY = "agent/preempt/{}"  # one checkpoint request per round, compare_set


def read_job_state(store: Store, run_id: str) -> tuple[int, dict[str, Any] | None]:
    """(restarts used, the published root cause or None), read-only, for ``elastic
    status``: every backend's ``describe`` reads the job-wide state through this."""
    restarts = 0
    if store.check([RESTARTS_KEY]):
        raw = store.get(RESTARTS_KEY)
        try:
            restarts = int(raw)
        except ValueError:
            raise RendezvousStateError(
                f"job state key {RESTARTS_KEY!r} is not a number: {bytes(raw[:60])!r}"
            ) from None
    return restarts, fail.published_root_cause(store, run_id)
