"""The job-wide keys every agent reads and writes in the rendezvous store, and how
``elastic status`` reads them back.

The backend namespaces the store by run id, so these names are the same for every job.
They live below the agent because the rendezvous backends' ``describe`` reads them too.
"""

from __future__ import annotations

import json
from typing import Any

from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.rendezvous import RendezvousStateError
from elastic.core.interfaces.store import Store

# The restart budget, one record: {"used": restarts spent, "rounds": the failed rounds
# charged (the newest ``BUDGET_ROUNDS``)}; claimed and charged in one compare_set.
BUDGET_KEY = "agent/restart_budget"
BUDGET_ROUNDS = 64
FAILED_KEY = "agent/failed"  # set once the job failed for good
BARRIER_KEY = "agent/exit_barrier/{}"  # nodes that finished the round
PREEMPT_KEY = "agent/preempt/{}"  # one checkpoint request per round, compare_set
READY_KEY = "agent/regroup/{}/ready"  # nodes whose workers can join the round's group
# set when workers kept from the last round finished the job while this round formed
FINISHED_KEY = "agent/regroup/{}/finished"
# nodes that gave up waiting for their workers to take the round and restarted them
REPLACED_KEY = "agent/regroup/{}/replaced"
# set once a node's workers created their group with elastic.init_process_group, which
# takes a round handed over while they started: from then on, workers still starting when
# the job re-forms are handed the new round instead of being restarted
LATE_ROUNDS_KEY = "agent/regroup/late_rounds"


def parse_budget(raw: bytes) -> tuple[int, list[int]]:
    """(restarts used, rounds charged) from the budget record (``b""``: none yet)."""
    if not raw:
        return 0, []
    try:
        record = json.loads(raw)
        used, rounds = record["used"], record["rounds"]
    except (ValueError, TypeError, KeyError, RecursionError):
        raise RendezvousStateError(
            f"job state key {BUDGET_KEY!r} is not a restart budget: {bytes(raw[:60])!r}"
        ) from None
    if not (isinstance(used, int) and isinstance(rounds, list)) or not all(
        isinstance(r, int) for r in rounds
    ):
        raise RendezvousStateError(f"job state key {BUDGET_KEY!r} holds {bytes(raw[:60])!r}")
    return used, list(rounds)


def budget_record(used: int, rounds: list[int]) -> bytes:
    rounds = rounds[-BUDGET_ROUNDS:]
    return json.dumps({"used": used, "rounds": rounds}, separators=(",", ":")).encode()


def read_job_state(store: Store, run_id: str) -> tuple[int, dict[str, Any] | None]:
    """(restarts used, the published root cause or None), read-only, for ``elastic
    status``: every backend's ``describe`` reads the job-wide state through this."""
    used, _ = parse_budget(store.multi_get([BUDGET_KEY])[0])
    return used, fail.published_root_cause(store, run_id)
