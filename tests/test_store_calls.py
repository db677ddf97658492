"""Store calls on the agent's decision paths, bounded by the handler's fencing
(``BoundedCalls``), and the exit barrier across a store that does not answer for a while.
A node cut off while it handles a failure, on real agents: ``tests/test_agent_faults.py``."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from elastic.core.agent.exit_barrier import BarrierEnd, exit_barrier
from elastic.core.agent.store_call import BoundedCalls, store_call
from elastic.core.interfaces.job_keys import BARRIER_KEY
from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousFencedError,
    RendezvousStoreGoneError,
)
from elastic.core.interfaces.store import LocalStore
from elastic.core.rendezvous.local import LocalRendezvousHandler


class FencingHandler(LocalRendezvousHandler):
    """Fenced once ``fenced`` is set, as the round's monitor is after heartbeat_timeout."""

    def __init__(self) -> None:
        super().__init__("job")
        self.fenced = threading.Event()

    def lost_nodes(self) -> list[str]:
        if self.fenced.is_set():
            raise RendezvousFencedError("cannot reach the rendezvous store")
        return []


def test_a_call_that_hangs_ends_when_the_handler_fences() -> None:
    handler = FencingHandler()
    calls = BoundedCalls(handler)
    never = threading.Event()
    threading.Timer(0.3, handler.fenced.set).start()
    t0 = time.monotonic()
    with pytest.raises(RendezvousFencedError):
        calls(never.wait, 30)
    assert time.monotonic() - t0 < 5
    never.set()


def fail(exc: Exception) -> None:
    raise exc


def test_bounded_call_outcomes() -> None:
    calls = BoundedCalls(FencingHandler())
    assert calls(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(RendezvousFencedError, match="cannot reach the rendezvous store"):
        calls(fail, RendezvousConnectionError("no answer in 10.0s"))
    with pytest.raises(RendezvousFencedError):
        calls(fail, OSError(110, "timed out"))  # what a raw client raises
    with pytest.raises(RendezvousStoreGoneError):  # final: nothing serves the store
        calls(fail, RendezvousStoreGoneError("connection refused"))
    with pytest.raises(ValueError):  # a bug is not a partition
        calls(fail, ValueError("bug"))


def test_the_exit_barrier_waits_across_a_store_that_does_not_answer() -> None:
    store = LocalStore()
    store.add(BARRIER_KEY.format(7), 1)  # the other member finished already
    cut_until = time.monotonic() + 0.5

    def call(fn: Any, *args: Any) -> Any:  # BoundedCalls while cut off: fenced
        if time.monotonic() < cut_until:
            raise RendezvousFencedError("cannot reach the rendezvous store")
        return store_call(fn, *args)

    end = exit_barrier(store, 7, 2, 30.0, lambda: [], call)
    assert end is BarrierEnd.DONE
    assert store.add(BARRIER_KEY.format(7), 0) == 2  # this node counted itself once
