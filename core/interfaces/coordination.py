"""The coordination-store interface the shared rendezvous round runs over.

One round algorithm (``elastic.core.rendezvous.round``) serves every dynamic backend; a backend is
an adapter that turns its server (torch's TCPStore protocol, etcd's v2 API, etcd's v3
API) into a ``CoordinationStore``. The operations are the ones a round needs and every
such server has: ``add`` (an atomic counter: join slots), ``compare_set`` (exactly one
writer wins: the round number, the assignment), ``get``/``multi_get`` (one round trip for
many keys), ``wait`` (block server-side, or watch, until keys exist), ``check`` and
``heartbeat`` (a liveness value; an adapter with leases attaches one, so a dead node's
key disappears by itself). "list" is done with counters and ``multi_get``: TCPStore has
no listing, and a counter makes every reader agree on the order.

Errors: a ``wait`` or ``get`` that timed out raises ``StoreTimeoutError``; a server that
cannot be reached raises ``RendezvousConnectionError``, and its subclass
``RendezvousStoreGoneError`` when the server's host answered that nothing listens (the
store process is gone) rather than not answering at all (a partition, a dead machine).

Values are bytes; everything the rendezvous stores is JSON. Keys are ``/``-separated
strings below the store's ``prefix``; adapters encode them as their server needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol, runtime_checkable

# How often a ``wait`` calls its ``tick`` while the keys are still missing.
WAIT_TICK = 1.0
# A ``wait``'s tick: what it raises ends the wait.
Tick = Callable[[], None]

# The longest a reachable host goes unheard on a connection that reports ``peer_silence``:
# transports that report it probe an idle connection every second (TCP keepalive), and a
# probe may land a little late; twice the period keeps a late answer from counting as
# silence.
HOST_HEARD_WITHIN = 2.0


@runtime_checkable
class CoordinationStore(Protocol):
    """A key-value view under ``prefix``; ``sub`` gives a narrower view on the same
    connection. ``where`` names the server for messages (``host:port``)."""

    prefix: str
    where: str

    def sub(self, prefix: str) -> CoordinationStore: ...

    def set(self, key: str, value: bytes | str) -> None: ...

    def get(self, key: str) -> bytes:
        """Block until ``key`` exists (up to the store's timeout); return its value."""
        ...

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); return it.
        ``add(key, 0)`` reads the counter (an adapter may make it a plain read)."""
        ...

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: if absent).
        Returns the value held afterwards: the caller won when it equals ``desired``."""
        ...

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values in ``keys`` order, ``b""`` for a key that does not exist; never blocks
        (stored values are never empty: JSON, counters, heartbeats). One round trip
        where the server allows."""
        ...

    def wait(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> None:
        """Block until every key exists; ``StoreTimeoutError`` after ``timeout``.
        ``tick`` is called on the waiting thread about every ``WAIT_TICK`` s while the
        keys are missing, and what it raises ends the wait: a caller gives up (the store
        was found lost, a line is due) without a thread of its own to watch the wait."""
        ...

    def wait_get(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> list[bytes]:
        """``wait``, then the keys' values as ``multi_get`` reads them: in the wait's own
        round trip where the server allows (a waiter reads what it waited for at once)."""
        ...

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists; never blocks."""
        ...

    def delete_key(self, key: str) -> bool: ...

    def heartbeat(self, key: str, value: bytes | str) -> None:
        """Write a liveness value and return only once the store applied it (the round's
        lease counts the answer as an acknowledged keep-alive). A store with leases ties
        the key to this client's lease (gone when the client dies)."""
        ...

    def peer_silence(self) -> float | None:
        """Seconds since the server's *host* last acknowledged this connection's packets
        (TCP keepalive answers included), or None when the transport cannot tell. A
        node whose lease ran out while a keep-alive waits in a store whose host was heard
        within ``HOST_HEARD_WITHIN`` waits for it instead of fencing: a store that is slow
        (its host overloaded, its process paused) is not a partition
        (``core/rendezvous/round/lease.py``)."""
        ...

    def close(self) -> None:
        """Release the connection (and the lease); idempotent."""
        ...
