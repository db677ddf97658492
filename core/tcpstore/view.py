"""A TCPStore connection that reconnects, and a ``CoordinationStore`` view of it under a
key prefix: what the c10d and static backends (and ``elastic status``) use.

Where a store that can move went is not decided here: ``Locator`` is the hook, and the
c10d plugin's succession (``plugins/rdzv_c10d/succession.py``) implements it, with every
rule of a handover (standby marks, the wait for one under way, the run's identity and
generations). This module knows only what the wire says: which requests can be sent
again, and which get no answer.

May import ``client``; outside ``tcpstore``, ``interfaces``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

from elastic.core.interfaces.coordination import Tick
from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousStoreGoneError,
    RendezvousStoreMovedError,
)
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.tcpstore.client import TCPStoreClient

# Operations that may be sent again after the store moved: repeating them changes nothing.
# ``add`` is not (a counter would count twice); its caller sees the connection error.
REPEATABLE = frozenset({"set", "get", "check", "multi_get", "multi_set", "compare_set"})
# Operations that get no answer in TCPStore's protocol: on a store that can move, each is
# followed by one that does (see ``Connection.call``).
UNANSWERED = frozenset({"set", "multi_set"})


class Locator(Protocol):
    """Where a store that can move is (c10d's succession policy, in its plugin)."""

    def accept(self, client: TCPStoreClient) -> None:
        """Raise ``RendezvousConnectionError`` unless ``client`` reached the job's store
        (asked of every connection made after the first)."""

    def find(self, conn: Connection) -> tuple[str, int, TCPStoreClient] | None:
        """After ``conn``'s store stopped answering: (host, port, a client) of the store
        it moved to, or None when it did not move."""


class Connection:
    """One client connection, made again after it broke: a node cut off for a while
    reconnects once the network is back. A store whose host answered that nothing serves
    it any more is final (``RendezvousStoreGoneError``, with ``gone_hint``: what it means
    for the job and what to do about it).

    A WAIT holds its connection until the keys appear, so waits run on connections of
    their own (kept for the next wait): a long wait never delays another thread's calls,
    and a wait its caller gave up on (its thread still parked) costs one connection, not
    the store."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        gone_hint: str = "",
        token: bytes | None = None,
        torch_ok: bool = False,
    ) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.token = token  # proved to the server on every connection (client.py)
        self.torch_ok = torch_ok  # with a token: torch's server is accepted (client.py)
        # Where the store is when it can move (c10d's handover); None: it cannot.
        self.locator: Locator | None = None
        self.gone_hint = gone_hint
        self.where = f"{host}:{port}"
        self._client: TCPStoreClient | None = None
        self._lock = threading.Lock()
        self._closed = False
        # Keys seen to exist; nothing the rendezvous writes to a TCPStore is ever deleted
        # (liveness is a value changing, not a key expiring), so they stay readable.
        self._present: set[str] = set()
        self._checks_first = False  # the server is torch's legacy one (see ``read``)
        self._older_server = False  # it closed a WAIT_GET's probe (``_new_waiter``)
        self._idle_waiters: list[TCPStoreClient] = []
        self._busy_waiters: set[TCPStoreClient] = set()
        self.beats: dict[str, bytes] = {}  # heartbeat key -> the value written there last

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RendezvousConnectionError(f"the store client for {self.where} is closed")

    def _current(self) -> TCPStoreClient:
        with self._lock:
            self._raise_if_closed()
            if self._client is not None and self._client.broken:
                # Its last request was interrupted (a signal): a new connection, not an error.
                self._client.close()
                self._client = None
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _connect(self) -> TCPStoreClient:
        client = TCPStoreClient(
            self.host, self.port, self.timeout, token=self.token, torch_ok=self.torch_ok
        )
        if self.locator is not None:
            try:
                self.locator.accept(client)
            except BaseException:
                client.close()
                raise
        return client

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, op: str, *args: Any) -> Any:
        try:
            return self._apply(self._current(), op, args)
        except RendezvousConnectionError as exc:
            self.reset()
            if not self.find_moved_store():
                raise self._final(exc) from None
            if op not in REPEATABLE:
                # Applied or not: nobody can tell. Not final (the store is there): the
                # caller's retry path, not its "store gone" path, takes it.
                raise RendezvousStoreMovedError(
                    f"the store moved to {self.where} during a {op.upper()}, whose outcome "
                    f"is unknown: {exc}"
                ) from None
            return self._apply(self._current(), op, args)

    def _apply(self, client: TCPStoreClient, op: str, args: tuple[Any, ...]) -> Any:
        if op in UNANSWERED and self.locator is not None:
            # Confirmed by an answer to a request sent with it: a store closed for a move
            # before it read the SET fails that instead, and the SET goes to the new one.
            return getattr(client, op)(*args, confirmed=True)
        return getattr(client, op)(*args)

    def find_moved_store(self) -> bool:
        """After this store stopped answering: ask the locator where it went and switch
        there; False when it did not move (or cannot)."""
        if self.locator is None or self._closed:
            return False
        found = self.locator.find(self)
        if found is None:
            return False
        self._move_to(*found)
        return True

    def _move_to(self, host: str, port: int, client: TCPStoreClient) -> None:
        # The locator's client was made to probe (a short timeout); from now on it carries
        # this connection's calls, bounded like every other one.
        client.timeout = self.timeout
        with self._lock:
            old, self._client = self._client, client
            self.host, self.port, self.where = host, port, f"{host}:{port}"
            self.torch_ok = False  # a store moves only to one of ours, which proves it
            self._present = set()
            self._older_server = False
            idle, self._idle_waiters = self._idle_waiters, []
        for stale in [old, *idle]:
            if stale is not None:
                stale.close()

    def wait(self, keys: list[str], timeout: timedelta | None, tick: Tick | None = None) -> None:
        """``TCPStoreClient.wait`` on a waiting connection (see the class). A store that
        moved meanwhile is a ``RendezvousConnectionError``: the caller waits again."""
        self._on_waiter("wait", keys, timeout, tick)

    def wait_get(
        self, keys: list[str], timeout: timedelta | None, tick: Tick | None = None
    ) -> list[bytes]:
        """``wait``, then the keys' values: ``TCPStoreClient.wait_get``."""
        return self._on_waiter("wait_get", keys, timeout, tick)

    def _on_waiter(
        self, op: str, keys: list[str], timeout: timedelta | None, tick: Tick | None
    ) -> Any:
        try:
            client = self._take_waiter()
        except RendezvousConnectionError as exc:
            if not self.find_moved_store():
                raise self._final(exc) from None
            client = self._take_waiter()
        try:
            result = getattr(client, op)(keys, timeout, tick)
        except StoreTimeoutError:
            self._return_waiter(client)  # the WAIT was cancelled: the stream is in step
            raise
        except RendezvousConnectionError as exc:
            self._drop_waiter(client)
            if self.find_moved_store():
                raise RendezvousConnectionError(
                    f"the store moved to {self.where} during a wait"
                ) from None
            raise self._final(exc) from None
        except BaseException:
            self._drop_waiter(client)
            raise
        self._return_waiter(client)
        return result

    def open_waiter(self) -> None:
        """Connect the first waiting connection now, so that no connection cost lands
        inside a round (a thousand nodes connecting at once slow it by half a second)."""
        self._return_waiter(self._take_waiter())

    def _take_waiter(self) -> TCPStoreClient:
        with self._lock:
            self._raise_if_closed()
            client = self._idle_waiters.pop() if self._idle_waiters else None
        if client is None:
            client = self._new_waiter()
        with self._lock:
            if self._closed:  # closed while this one connected
                client.close()
                self._raise_if_closed()
            self._busy_waiters.add(client)
        return client

    def _new_waiter(self) -> TCPStoreClient:
        """A new waiting connection, asked once whether its server takes WAIT_GET (a
        server of ours, before a round needs it); one that closed it, an older server of
        ours (a node let in with ``allow_mismatch=elastic``), is made again, unasked."""
        client = self._connect()
        if self._older_server:
            return client
        try:
            client.probe_wait_get()
        except RendezvousStoreGoneError:
            self._older_server = True
            client = self._connect()
        return client

    def _return_waiter(self, client: TCPStoreClient) -> None:
        with self._lock:
            self._busy_waiters.discard(client)
            if not self._closed:
                self._idle_waiters.append(client)
                return
        client.close()

    def _drop_waiter(self, client: TCPStoreClient) -> None:
        with self._lock:
            self._busy_waiters.discard(client)
        client.close()

    def _final(self, exc: RendezvousConnectionError) -> RendezvousConnectionError:
        """What to raise for ``exc`` once the store did not move."""
        return self._gone(exc) if isinstance(exc, RendezvousStoreGoneError) else exc

    def _gone(self, exc: RendezvousStoreGoneError) -> RendezvousStoreGoneError:
        hint = f"; {self.gone_hint}" if self.gone_hint else ""
        return RendezvousStoreGoneError(f"lost the rendezvous store: {exc}{hint}")

    def read(self, keys: list[str]) -> list[bytes]:
        """Current values, ``b""`` for a missing key, never blocking: one MULTI_GET.

        Without a WAIT before it, torch's libuv server and ours answer a missing key with
        ``b""``; torch's legacy server (``use_libuv=False``) closes the connection instead.
        So when a MULTI_GET naming a key not yet seen closes the connection, this
        connection CHECKs every key once before reading it from then on (a store that
        really went away fails that retry with its own error)."""
        if self._checks_first:
            unknown = [k for k in dict.fromkeys(keys) if k not in self._present]
            if unknown and self.call("check", unknown):
                self._present.update(unknown)
            elif unknown:
                self._present.update(k for k in unknown if self.call("check", [k]))
            asked = [k for k in dict.fromkeys(keys) if k in self._present]
        else:
            asked = list(dict.fromkeys(keys))
        try:
            values = dict(zip(asked, self.call("multi_get", asked, False), strict=True))
        except RendezvousStoreGoneError:
            if self._checks_first or all(k in self._present for k in asked):
                raise
            self._checks_first = True
            self.reset()
            return self.read(keys)
        self._present.update(k for k, v in values.items() if v)
        return [values.get(k, b"") for k in keys]

    def peer_silence(self) -> float | None:
        """``TCPStoreClient.peer_silence`` of the current connection (None while there
        is none: being made again, or never made)."""
        client = self._client
        return client.peer_silence() if client is not None else None

    def forget(self, key: str) -> None:
        self._present.discard(key)

    def reset(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            # Possibly another server now (a restarted host): learn its keys again.
            self._present = set()
            idle, self._idle_waiters = self._idle_waiters, []
        for old in [client, *idle]:
            if old is not None:
                old.close()

    def close(self) -> None:
        """Closes every connection, waking a wait parked in another thread."""
        with self._lock:
            self._closed = True
            busy, self._busy_waiters = list(self._busy_waiters), set()
        self.reset()
        for client in busy:
            client.close()


class PrefixStore:
    """A ``CoordinationStore`` view of one connection under a key prefix."""

    def __init__(self, conn: Connection, prefix: str) -> None:
        self._conn = conn
        self.prefix = prefix

    @property
    def where(self) -> str:
        """The store's address now: a moved store's new one (read from the connection)."""
        return self._conn.where

    def sub(self, prefix: str) -> PrefixStore:
        return PrefixStore(self._conn, self.prefix + prefix)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._conn.call("set", self._k(key), value)

    def heartbeat(self, key: str, value: bytes | str) -> None:
        """Write a liveness value and return once the store applied it. No leases in
        TCPStore: liveness is the value changing. A SET has no answer in TCPStore's
        protocol, so this is a COMPARE_SET against the value this connection wrote there
        last, which does answer; a key that holds something else (a store that
        restarted, a beat whose answer was lost) is read from the answer and replaced,
        as a SET would."""
        full, new = self._k(key), value if isinstance(value, bytes) else value.encode()
        expected = self._conn.beats.get(full, b"")
        for _ in range(3):
            held = bytes(self._conn.call("compare_set", full, expected, new))
            if held == new:
                self._conn.beats[full] = new
                return
            # Absent with a non-empty ``expected``: torch's answer is ``expected``.
            expected = b"" if held == expected else held
        raise RendezvousConnectionError(
            f"heartbeat {full!r} at {self.where}: the key keeps changing"
        )

    def get(self, key: str) -> bytes:
        return bytes(self._conn.call("get", self._k(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self._conn.call("add", self._k(key), amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self._conn.call("compare_set", self._k(key), expected, desired))

    def wait(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> None:
        self._conn.wait([self._k(k) for k in keys], timeout, tick)

    def wait_get(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> list[bytes]:
        return self._conn.wait_get([self._k(k) for k in keys], timeout, tick)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._conn.call("check", [self._k(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        self._conn.forget(self._k(key))
        return bool(self._conn.call("delete_key", self._k(key)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """One round trip for many keys; a missing key reads as ``b""``."""
        return self._conn.read([self._k(k) for k in keys]) if keys else []

    def peer_silence(self) -> float | None:
        return self._conn.peer_silence()

    def close(self) -> None:
        self._conn.close()
