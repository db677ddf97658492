"""The exit barrier: a node whose workers succeeded waits for the round's other members
before it leaves, so a node hosting the store does not take it away from nodes still
finishing."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.job_keys import BARRIER_KEY, CLAIM_KEY, FAILED_KEY
from elastic.core.interfaces.rendezvous import RendezvousError
from elastic.core.interfaces.store import Store


class BarrierEnd(enum.Enum):
    DONE = "done"  # every member that is still one arrived (or the timeout passed)
    FAILED = "failed"  # the job failed meanwhile (another node spent the last restart)
    RESTART = "restart"  # another node's workers failed this round: rejoin


def exit_barrier(
    store: Store, round_: int, world_size: int, timeout: float, lost: Callable[[], list[str]]
) -> BarrierEnd:
    """Wait (up to ``timeout`` s) for every node of the round that is still a member
    to finish. A node that left or died is never waited for: the barrier is done once
    every other member has arrived."""
    key = BARRIER_KEY.format(round_)
    store_call(store.add, key, 1)
    # One read per poll: a whole job finishing at once polls together.
    keys = [f"{key}/done", FAILED_KEY, CLAIM_KEY.format(round_), key]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed, claim, arrived = store_call(store.multi_get, keys)
        if done:
            return BarrierEnd.DONE
        if failed:
            return BarrierEnd.FAILED
        if claim:
            return BarrierEnd.RESTART
        try:
            gone = len(lost())
        except RendezvousError:
            gone = 0  # cannot tell (fenced): wait for everyone, bounded by the timeout
        if int(arrived or b"0") >= world_size - gone:
            store_call(store.set, f"{key}/done", "1")
            return BarrierEnd.DONE
        time.sleep(0.1)
    return BarrierEnd.DONE  # as torch: a peer that never arrives does not fail this node
