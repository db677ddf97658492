"""Was a worker failure caused by a node leaving? Then it costs no restart.

When a member of the round dies or departs, the survivors' workers usually fail first
(gloo: "Connection closed by peer"), before the rendezvous has published the loss. Such
a failure must re-form the group without spending the restart budget or being reported
as the root cause. This module decides, from the rendezvous and the failure records.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elastic.core.agent.restarts import restart_claimed
from elastic.core.agent.store_call import store_call
from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.rendezvous import RendezvousHandler
from elastic.core.interfaces.store import Store

# How long a worker failure that looks like a lost peer (gloo/NCCL connection errors)
# waits for the rendezvous to confirm a departure before it spends a restart: longer than
# the default heartbeat_timeout (5 s), so a crashed peer is found stale in time.
PEER_LOSS_WAIT = 7.0
# Between reads of the other members' heartbeats (only for a failure that says nothing).
BEATS_READ_INTERVAL = 0.5


def departure_caused(
    handler: RendezvousHandler,
    store: Store | None,
    round_: int,
    records: list[fail.FailureRecord],
    sleep: Callable[[float], None] = time.sleep,
    call: Callable[..., Any] = store_call,
) -> bool:
    """At once if a departure is already known (a departing node says so before its
    workers stop); otherwise, unless the workers' own errors show a failure of their
    own, after waiting up to ``PEER_LOSS_WAIT`` for the rendezvous to confirm a crashed
    peer. Another node claiming a restart first means a real failure; so does, for a
    failure that says nothing of its cause (an exit code alone), every other member's
    agent beating since the failure (``peer_heartbeats``): none of them left.

    ``call`` makes each store call (the agent's ``BoundedCalls``: a partition meanwhile
    fences this node instead of holding it for the store client's timeout)."""
    if call(handler.membership_changed):
        return True
    if not all(fail.may_be_peer_loss(record) for record in records):
        return False
    # Only a failure that says nothing reads the beats: a connection error is the usual
    # way a peer's failure shows, and the node that failed first claims the restart.
    beats = call(handler.peer_heartbeats) if any(map(fail.says_nothing, records)) else None
    started = time.monotonic()
    deadline, next_beats = started + PEER_LOSS_WAIT, started + BEATS_READ_INTERVAL
    while time.monotonic() < deadline:
        sleep(0.25)
        if call(handler.membership_changed):
            return True
        if store is not None and call(restart_claimed, store, round_):
            return False  # another node's workers failed first: a real failure
        if beats is not None and time.monotonic() >= next_beats:
            next_beats = time.monotonic() + BEATS_READ_INTERVAL
            if all_beat_since(beats, call(handler.peer_heartbeats)):
                return False  # every other member is alive: nobody left
    return False


def all_beat_since(before: dict[str, bytes | None], now: dict[str, bytes | None] | None) -> bool:
    """Whether every member in ``before`` has a live heartbeat in ``now`` that differs
    from the one it had in ``before``."""
    if now is None:
        return False
    return all(now.get(m) is not None and now.get(m) != beat for m, beat in before.items())
