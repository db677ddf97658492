"""What ``TCPStoreServer`` serves: the keys, the queues and the parked waits, and the answer
to every request past the handshake, as torch's libuv server (its default) answers it.

torch 2.13's and 2.14's clients send all of these; ``tests/test_tcpstore_torch_diff.py``
runs the same operations from a real ``torch.distributed.TCPStore`` client against
torch's server and this one and compares what the client sees. What torch does, and so
what this does:

- Keys and queues are two namespaces under the same names: ``QUEUE_PUSH`` never touches a
  key, ``DELETE_KEY``, ``GETNUMKEYS`` and ``LIST_KEYS`` never see a queue. ``CHECK`` and
  ``WAIT`` take a key as present when it is set or its queue is not empty.
- ``SET``, ``ADD``, ``APPEND``, ``COMPARE_SET`` (when it writes) wake every wait parked on
  the key; ``QUEUE_PUSH`` wakes one, the longest parked (torch's client pops a blocking
  ``queue_pop`` after a ``WAIT``, so one push lets one popper through).
- ``QUEUE_POP`` answers the queue's length before the pop, then the value it took when
  that was not 0 (the client raises ``QueueEmptyError`` on 0).
- ``BARRIER key n`` counts on the key as ``ADD key 1`` does (the count is the key's
  value) but wakes nobody while the count is below ``n``: the caller is parked on the key
  until it is written again (another ``BARRIER`` reaching its own ``n``, a ``SET``...),
  and a client giving up sends ``CANCEL_WAIT``, as for a ``WAIT``.
- ``ADD`` reads the value as C's ``strtoll`` does (leading blanks, a sign, the digits;
  the rest ignored) and wraps around at 64 bits; a value with no number drops the
  connection, as torch's server drops it.

The server's limits stay: requests are bounded by ``wire``; an answer (``GET``,
``MULTI_GET``, ``LIST_KEYS``) over ``limits.MAX_REPLY_LEN`` drops the connection that
asked. The store itself is not capped, as torch's is not. A store handed over
(``TCPStoreServer.close_and_take``, c10d's handover) carries its keys, barrier counts
included, but not its queues: the rendezvous never uses one.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from elastic.core.tcpstore import limits, wire
from elastic.core.tcpstore.wire import Query

_LEADING_INT = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_INT64 = range(-(2**63), 2**63)


class Drop(Exception):
    """Close this connection (a protocol violation, or the peer went away)."""


class Limit(Drop):
    """Close this connection: it went beyond one of ``limits`` (named by ``limit``)."""

    def __init__(self, limit: str, what: str) -> None:
        super().__init__(what)
        self.limit = limit


class Waiter(Protocol):
    """The part of a server's connection a parked request uses."""

    outbuf: bytearray
    # The keys a parked WAIT (or BARRIER) still waits for; None when none is parked.
    missing: set[bytes] | None
    # A parked WAIT_GET's keys, whose values go with its STOP_WAITING; None otherwise.
    reads: tuple[bytes, ...] | None


W = TypeVar("W", bound=Waiter)


class ServedStore(Generic[W]):
    """The store of one server. ``wake(conn)`` is called when a parked connection was
    answered by another one's request, so the server sends that answer; ``deleted(key)``
    when a request deleted ``key``."""

    def __init__(
        self,
        data: dict[bytes, bytes],
        wake: Callable[[W], object],
        deleted: Callable[[bytes], object] = lambda key: None,
    ) -> None:
        self.data = data
        self._deleted = deleted  # told of each key a DELETE_KEY removed
        self.queues: dict[bytes, collections.deque[bytes]] = {}
        # Connections parked on each key, in the order they parked (a push wakes the first).
        self._waiters: dict[bytes, dict[W, None]] = {}
        self._wake = wake

    def answer(self, conn: W, req: wire.Request) -> None:
        """Do ``req`` and append its answer (if it has one now) to ``conn.outbuf``."""
        query, key, out = req.query, req.key, conn.outbuf
        if query is Query.SET:
            self.set(key, req.value)
        elif query is Query.MULTI_SET:
            for pair_key, value in req.pairs:
                self.set(pair_key, value)
        elif query is Query.APPEND:
            self.set(key, self.data.get(key, b"") + req.value)
        elif query is Query.GET:
            # A missing key reads as empty, as on torch's libuv server (its clients WAIT
            # first, so only a raw client, or a key that is only a queue, sees this).
            out += wire.blob(self._values_within_limit([key])[0])
        elif query is Query.MULTI_GET:
            for value in self._values_within_limit(req.keys):
                out += wire.blob(value)
        elif query is Query.ADD:
            total = self._count(key, req.number)
            self.set(key, str(total).encode())
            out += wire.I64.pack(total)
        elif query is Query.COMPARE_SET:
            out += wire.blob(self._compare_set(key, req.value, req.desired))
        elif query is Query.CHECK:
            ready = all(self._present(k) for k in req.keys)
            out += wire.U8.pack(wire.READY if ready else wire.NOT_READY)
        elif query is Query.WAIT:
            self._park(conn, [k for k in req.keys if not self._present(k)])
        elif query is Query.WAIT_GET:
            self._park(conn, [k for k in req.keys if not self._present(k)], req.keys)
        elif query is Query.CANCEL_WAIT:
            self.unpark(conn)
            out += wire.U8.pack(wire.WAIT_CANCELED)
        elif query is Query.DELETE_KEY:
            removed = self.data.pop(key, None) is not None
            out += wire.I64.pack(int(removed))
            if removed:
                self._deleted(key)
        elif query is Query.GETNUMKEYS:
            out += wire.I64.pack(len(self.data))
        elif query is Query.LIST_KEYS:
            self._check_reply_size(sum(wire.U64.size + len(k) for k in self.data))
            out += wire.I64.pack(len(self.data))
            for name in self.data:
                out += wire.blob(name)
        elif query is Query.QUEUE_PUSH:
            self.queues.setdefault(key, collections.deque()).append(req.value)
            self._wake_waiters(key, one=True)
        elif query is Query.QUEUE_POP:
            self._pop(key, out)
        elif query is Query.QUEUE_LEN:
            out += wire.I64.pack(len(self.queues.get(key, ())))
        elif query is Query.BARRIER:
            count = self._count(key, 1)
            self.data[key] = str(count).encode()  # torch wakes nobody below the count
            if count >= req.number:
                out += wire.U8.pack(wire.STOP_WAITING)
                self._wake_waiters(key)
            else:
                self._park(conn, [key])
        else:
            raise Drop(f"unexpected {query.name}")  # VALIDATE a second time

    # --- keys ------------------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        self.data[key] = value
        self._wake_waiters(key)

    def clear(self, keep_prefix: bytes) -> int:
        """Delete every key and queue whose name does not start with ``keep_prefix``; how
        many keys went. Waiters stay parked: a deleted key was present, so nobody waits
        for it."""
        doomed = [key for key in self.data if not key.startswith(keep_prefix)]
        for key in doomed:
            del self.data[key]
        for name in [name for name in self.queues if not name.startswith(keep_prefix)]:
            del self.queues[name]
        return len(doomed)

    def _present(self, key: bytes) -> bool:
        return key in self.data or bool(self.queues.get(key))

    def _count(self, key: bytes, amount: int) -> int:
        """The key's number plus ``amount``, wrapped to int64 (``ADD``, ``BARRIER``)."""
        match = _LEADING_INT.match(self.data.get(key, b"0"))
        if match is None:
            raise Drop(f"{key!r} holds no integer to add to")
        current = int(match.group(1))
        if current not in _INT64:
            raise Drop(f"{key!r} holds an integer beyond int64")
        return (current + amount + 2**63) % 2**64 - 2**63

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self.data.get(key)
        if current is None:
            if expected:
                return expected  # torch's answer for an absent key: "expected", unchanged
            self.set(key, desired)
            return desired
        if current == expected:
            self.set(key, desired)
            return desired
        return current

    def _values_within_limit(self, keys: Iterable[bytes]) -> list[bytes]:
        """The values of ``keys`` (``b""`` when missing), unless their answer would pass
        ``MAX_REPLY_LEN``: measured before a byte of it is built."""
        values = [self.data.get(key, b"") for key in keys]
        self._check_reply_size(sum(wire.U64.size + len(value) for value in values))
        return values

    @staticmethod
    def _check_reply_size(size: int) -> None:
        if size > limits.MAX_REPLY_LEN:
            raise Limit("MAX_REPLY_LEN", f"a request for a {size}-byte answer")

    # --- queues ----------------------------------------------------------------------------

    def _pop(self, name: bytes, out: bytearray) -> None:
        queue = self.queues.get(name)
        out += wire.I64.pack(len(queue) if queue else 0)
        if queue:
            out += wire.blob(queue.popleft())
            if not queue:
                del self.queues[name]

    # --- parked requests -------------------------------------------------------------------

    def _park(self, conn: W, keys: list[bytes], reads: tuple[bytes, ...] | None = None) -> None:
        """Park ``conn`` until ``keys`` are present (answered at once when none is
        missing); ``reads``: a WAIT_GET's keys, whose values go with the answer."""
        if conn.missing is not None:
            raise Drop("a second WAIT while one is parked")
        if not keys:
            conn.outbuf += self._stop_waiting(reads)
            return
        conn.missing = set(keys)
        conn.reads = reads
        for key in conn.missing:
            self._waiters.setdefault(key, {})[conn] = None

    def _stop_waiting(self, reads: tuple[bytes, ...] | None) -> bytes:
        """A parked request's answer: STOP_WAITING, and a WAIT_GET's values (``wire``)."""
        if reads is None:
            return wire.U8.pack(wire.STOP_WAITING)
        try:
            values = self._values_within_limit(reads)
        except Limit:  # the client reads them with MULTI_GET, which the limit governs
            return wire.U8.pack(wire.STOP_WAITING) + wire.U8.pack(wire.NO_VALUES)
        answer = [wire.U8.pack(wire.STOP_WAITING), wire.U8.pack(wire.VALUES)]
        return b"".join(answer + [wire.blob(value) for value in values])

    def unpark(self, conn: W) -> None:
        for key in conn.missing or ():
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.pop(conn, None)
                if not waiters:
                    del self._waiters[key]
        conn.missing = None
        conn.reads = None

    def _wake_waiters(self, key: bytes, one: bool = False) -> None:
        """Tell the connections parked on ``key`` (the first only, with ``one``) that it
        is there; each is answered once it waits for nothing else."""
        waiters = self._waiters.get(key)
        if not waiters:
            return
        if one:
            woken = [next(iter(waiters))]
            del waiters[woken[0]]
            if not waiters:
                del self._waiters[key]
        else:
            woken = list(self._waiters.pop(key))
        for waiter in woken:
            assert waiter.missing is not None  # only a parked connection is a waiter
            waiter.missing.discard(key)
            if not waiter.missing:
                waiter.missing = None
                waiter.outbuf += self._stop_waiting(waiter.reads)
                waiter.reads = None
                # The server sends it: a failure to send to the waiter must drop the
                # waiter, not the connection whose request woke it.
                self._wake(waiter)
