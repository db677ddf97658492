"""The exit barrier: a node whose workers succeeded waits for the round's other members
before it leaves, so a node hosting the store does not take it away from nodes still
finishing."""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.job_keys import BARRIER_KEY, BUDGET_KEY, FAILED_KEY, parse_budget
from elastic.core.interfaces.rendezvous import (
    RendezvousError,
    RendezvousFencedError,
    RendezvousStoreMovedError,
)
from elastic.core.interfaces.store import Store, StoreTimeoutError

POLL = 0.1  # s between the barrier's reads of who arrived, failed or is gone


class BarrierEnd(enum.Enum):
    DONE = "done"  # every member that is still one arrived
    FAILED = "failed"  # the job failed meanwhile (another node spent the last restart)
    RESTART = "restart"  # another node's workers failed this round: rejoin
    TIMED_OUT = "timed_out"  # a member neither arrived nor was found gone: not a success


def exit_barrier(
    store: Store,
    round_: int,
    world_size: int,
    timeout: float,
    lost: Callable[[], list[str]],
    call: Callable[..., Any] = store_call,
) -> BarrierEnd:
    """Wait (up to ``timeout`` s) for every node of the round that is still a member
    to finish. A node that left or died is never waited for: the barrier is done once
    every other member has arrived.

    ``call`` makes each store call (the agent's ``BoundedCalls``). A store this node
    cannot reach for a while (a partition: ``RendezvousFencedError``) does not end the
    barrier: its workers succeeded, so it goes on asking until the store answers or the
    timeout passes. A timeout is ``TIMED_OUT``, never ``DONE``: whether the job succeeded
    is then unknown here (``exit_code``)."""
    key = BARRIER_KEY.format(round_)
    # One read per poll: a whole job finishing at once polls together.
    keys = [f"{key}/done", FAILED_KEY, BUDGET_KEY, key]
    deadline = time.monotonic() + timeout
    counted = False
    wait = 0.0  # the first read goes out at once
    while time.monotonic() < deadline:
        try:
            if not counted:
                call(store.add, key, 1)
                counted = True
            done, failed, budget, arrived = call(_read_once_done, store, keys, wait)
        except (RendezvousFencedError, RendezvousStoreMovedError):
            time.sleep(0.1)  # cut off for now, or moved: the store may answer again
            continue
        if done:
            return BarrierEnd.DONE
        if failed:
            return BarrierEnd.FAILED
        if round_ in parse_budget(budget)[1]:
            return BarrierEnd.RESTART
        try:
            gone = len(lost())
        except RendezvousError:
            gone = 0  # cannot tell (fenced): wait for everyone, bounded by the timeout
        if _count(arrived) >= world_size - gone:
            # the others count arrivals too
            with contextlib.suppress(RendezvousFencedError, RendezvousStoreMovedError):
                call(store.set, f"{key}/done", "1")
            return BarrierEnd.DONE
        wait = min(POLL, deadline - time.monotonic())
    return BarrierEnd.TIMED_OUT


def _read_once_done(store: Store, keys: list[str], seconds: float) -> list[bytes]:
    """The barrier's ``keys``, read once the last arrival's "done" (``keys[0]``) is set
    or ``seconds`` passed, in one bounded call: a job whose members finish together
    leaves together, not up to a poll later each (a sleep between reads held every node
    but the last one ~0.05 s longer, and the store's host after them)."""
    if seconds > 0:
        with contextlib.suppress(StoreTimeoutError):
            store.wait([keys[0]], timedelta(seconds=seconds))
    return store.multi_get(keys)


def _count(raw: bytes) -> int:
    """The arrivals counter; anything but a number (anyone may write one) is none yet."""
    try:
        return int(raw or b"0")
    except ValueError:
        return 0
