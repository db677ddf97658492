"""Every store call on the agent's paths goes through ``store_call``: whatever the
backend's client raises when its server is gone, the agent sees one error type.

Calls the agent makes on its own thread while deciding (a failure, a departure, the
restart budget) go through ``BoundedCalls`` as well: a partition can never hold the agent
longer than the handler takes to fence it, and a store that does not answer leads to
fencing and rejoining, never to an exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousFencedError,
    RendezvousHandler,
    RendezvousStoreGoneError,
    RendezvousStoreMovedError,
)
from elastic.core.workers.process import Interrupted

T = TypeVar("T")

# How often a bounded call asks the handler whether this node is fenced while it waits;
# the answer is cached by the handler (``lost_nodes``), so asking costs nothing.
FENCE_POLL = 0.1


def store_call(fn: Callable[..., T], *args: Any) -> T:
    """Call the store or handler; a broken connection becomes RendezvousConnectionError.

    torch's TCPStore raises RuntimeError (DistNetworkError) or OSError when its server
    is gone; whatever the backend, the agent must answer with one clear line.
    """
    try:
        return fn(*args)
    except (RendezvousError, Interrupted):
        raise
    except (OSError, RuntimeError) as exc:
        raise RendezvousConnectionError(f"{type(exc).__name__}: {exc}") from exc


class _Pending(Generic[T]):
    """One call running on a thread of its own; its result or error once ``done``."""

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self.done = threading.Event()
        self._fn, self._args = fn, args
        self._result: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = store_call(self._fn, *self._args)
        except BaseException as exc:  # handed to the agent's thread, which decides
            self._error = exc
        finally:
            self.done.set()

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


class BoundedCalls:
    """``calls(fn, *args)``: ``store_call(fn, *args)`` that never outlasts the handler's
    fencing.

    The call runs on a daemon thread while the agent's thread waits for it and asks the
    handler, every ``FENCE_POLL`` s, whether this node is still a member
    (``lost_nodes()``: cached, it raises ``RendezvousFencedError`` once the store has not
    answered for the liveness timeout, or the job declared this node lost). So a call
    across a partition returns within about ``heartbeat_timeout`` whatever the store
    client's own ``read_timeout`` is. A call abandoned that way finishes or fails on its
    thread later and its result is dropped; a request already sent may still reach the
    store after the partition heals (TCP retransmits it). That is harmless on these
    paths: a failure record published late, the claim of a round the job has left
    behind (it may count one restart for a failure that did happen), ``agent/failed``
    only once the budget was spent.

    The outcomes, for the agent's loop: the store answered (its value); this node is
    fenced, or the store did not answer (``RendezvousFencedError``: stop the workers and
    rejoin, which waits for the store up to ``join_timeout``); the store's host said that
    nothing serves the store any more (``RendezvousStoreGoneError``: final, as before); the
    store moved while a request that cannot be repeated was in flight
    (``RendezvousStoreMovedError``: it answers where it is now, so the caller decides, as
    the agent does for a regroup in place).
    A backend with no liveness tracking never fences: its client's own timeout bounds the
    call, and an unanswered call still becomes ``RendezvousFencedError``.
    """

    def __init__(self, handler: RendezvousHandler, poll: float = FENCE_POLL) -> None:
        self._handler = handler
        self._poll = poll

    def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        pending: _Pending[T] = _Pending(fn, args)
        name = f"store-call-{getattr(fn, '__name__', 'call')}"
        threading.Thread(target=pending.run, name=name, daemon=True).start()
        started = time.monotonic()
        while not pending.done.wait(self._poll):
            self._handler.lost_nodes()  # raises RendezvousFencedError once fenced
        try:
            return pending.result()
        except (
            RendezvousStoreGoneError,
            RendezvousStoreMovedError,
            RendezvousFencedError,
            Interrupted,
        ):
            raise
        except RendezvousConnectionError as exc:
            waited = time.monotonic() - started
            raise RendezvousFencedError(
                f"cannot reach the rendezvous store ({exc}; after {waited:.1f}s): stopping "
                "this node's workers; it rejoins when the store answers"
            ) from exc
