"""``TCPStoreClient``: a torch-free client for torch's TCPStore protocol.

It speaks to torch's own server (libuv or legacy) and to ``TCPStoreServer`` alike, with
``torch.distributed.Store`` semantics. One socket, requests serialised by a lock (the
protocol has no request ids, so a response is matched to its request by order only).

With a ``token`` the client and the server prove it to each other before anything else
(``wire``: the AUTH handshake, the server's proof first), so a listener without the token
on a candidate endpoint gets nothing from us and is never taken for the job's store. A
store that closes the connection at the handshake is busy (over its caps for
connections that have not proved the token, ``admission``) and is tried again until
``connect_timeout``, never read as "gone". torch's own server cannot prove a token and
closes a connection that asks, just as one busy or an impostor might: a client with a
token accepts it only where the user said the store is external (``torch_ok``: c10d's
``is_host=false``), and is then connected to again without the handshake, once per
endpoint and process. A client without a token still asks, so a store that wants one is
one clear error rather than a dropped connection, and takes a store that closes at the
handshake for torch's (it expects no proof).

Every socket operation has a deadline: a server whose link went silently down (no RST)
is reported after ``timeout`` seconds instead of hanging. After any connection error the
response stream can no longer be trusted, so the client is dead from then on: every
later call raises the same kind of error (the socket and its deadlines: ``channel``).

Owns connecting, the handshakes and the Store API. May import ``channel`` and ``wire``;
outside ``tcpstore``, ``interfaces``.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Sequence
from datetime import timedelta

from elastic.core.interfaces.coordination import WAIT_TICK, Tick
from elastic.core.interfaces.rendezvous import (
    RendezvousAuthError,
    RendezvousConnectionError,
    RendezvousStoreGoneError,
)
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.tcpstore import wire
from elastic.core.tcpstore.channel import Channel, WaitExpired
from elastic.core.tcpstore.wire import Query

log = logging.getLogger(__name__)

# Endpoints served by torch's own TCPStore (it closed a connection that asked for the
# token handshake, where that is accepted): later connections skip the handshake.
# Process-wide, as the servers are.
_TORCH_SERVED: set[str] = set()
# A store that closes connections during the handshake is tried again after this pause,
# doubled each time up to ``BUSY_PAUSE_MAX``, until the connect timeout.
BUSY_PAUSE = 0.05
BUSY_PAUSE_MAX = 1.0
TORCH_OK_HINT = "if torch's TCPStore server serves it, say so with --rdzv-conf is_host=false"
TOKEN_HINT = (
    "--rdzv-conf token_file=PATH, or ELASTIC_RDZV_TOKEN_FILE=PATH or ELASTIC_RDZV_TOKEN "
    "in the environment"
)


class _Busy(Exception):
    """The server closed the connection during the handshake (``at_hello``: when asked
    for the token handshake, as torch's server does)."""

    def __init__(self, what: str, at_hello: bool = False) -> None:
        super().__init__(what)
        self.at_hello = at_hello


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class TCPStoreClient(Channel):
    """A connection to a TCPStore server at ``host:port``.

    ``timeout`` (seconds) bounds every operation, and is the default for ``wait`` and
    ``get`` (which block until their keys exist); ``connect_timeout`` (default:
    ``timeout``) bounds the connection and handshake, retried while the store closes
    connections during the handshake (busy). Connection refused is not retried: the
    caller decides whether a store that is not up yet is worth waiting for. ``torch_ok``:
    with a token, accept a store that cannot prove it (torch's; see the module).
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float = 10.0,
        connect_timeout: float | None = None,
        token: bytes | None = None,
        torch_ok: bool = False,
    ) -> None:
        super().__init__(host, port, timeout)
        self.ours = False  # the server is ours: it answered the token handshake
        # It answers WAIT_GET (``probe_wait_get``; an older server of ours does not).
        self.takes_wait_get = False
        limit = timeout if connect_timeout is None else connect_timeout
        deadline = time.monotonic() + limit
        pause = BUSY_PAUSE
        while True:
            try:
                self._open(token, torch_ok, deadline)
                return
            except _Busy as busy:
                if time.monotonic() + pause >= deadline:
                    hint = f" ({TORCH_OK_HINT})" if busy.at_hello and token is not None else ""
                    raise RendezvousConnectionError(
                        f"TCPStore {self.where}: {busy} on every try for {limit:.1f}s: the "
                        f"store is busy, or cannot prove the job token{hint}"
                    ) from None
                time.sleep(pause)
                pause = min(2 * pause, BUSY_PAUSE_MAX)

    def _open(self, token: bytes | None, torch_ok: bool, deadline: float) -> None:
        """Connect and prove the token; ``_Busy`` when the server closed the connection
        during the handshake (the client is then closed)."""
        self._connect(max(deadline - time.monotonic(), 0.001))
        accepts_torch = token is None or torch_ok
        if self.where in _TORCH_SERVED and accepts_torch:
            return
        try:
            self._authenticate(token)
            self.ours = True
        except _Busy as busy:
            if not (busy.at_hello and accepts_torch):
                raise
            # torch's server closes a connection that asks: connect again, without asking.
            _TORCH_SERVED.add(self.where)
            if token is not None:
                log.warning(
                    "the store at %s is torch's TCPStore, which cannot check the job "
                    "token: anyone who reaches it can write to it (the job's signed "
                    "records still ignore what they write)",
                    self.where,
                )
            self._connect(max(deadline - time.monotonic(), 0.001))

    def _connect(self, limit: float) -> None:
        """Open a socket and check it reaches a TCPStore server (torch's VALIDATE and
        PING); ``_Busy`` when the server closed the connection at that handshake."""
        handshake_deadline = time.monotonic() + limit
        self.open_socket(limit)
        nonce = os.getpid() & 0xFFFFFFFF  # as torch's; any value does, if it comes back
        try:
            with self._lock:
                answer = self._roundtrip(
                    wire.handshake(nonce), lambda _: self._u32(handshake_deadline)
                )
        except RendezvousStoreGoneError:  # it accepted, then closed: alive, and busy
            self.close()
            raise _Busy("closed the connection at the handshake") from None
        except BaseException:  # a failed handshake, or Ctrl-C during it: no socket left
            self.close()
            raise
        if answer != nonce:
            self.close()
            raise RendezvousConnectionError(
                f"{self.where} is not a TCPStore server (ping answered {answer:#x})"
            )

    def _authenticate(self, token: bytes | None) -> None:
        """The token handshake (``wire``): the server proves the token first, then we
        do. ``_Busy`` when the server closed the connection instead."""
        ours = secrets.token_bytes(wire.AUTH_CHALLENGE_LEN) if token is not None else b""

        def challenge_and_proof(deadline: float) -> tuple[bytes, bytes]:
            return self._blob(deadline, wire.MAX_AUTH_LEN), self._blob(deadline, wire.MAX_AUTH_LEN)

        try:
            with self._lock:
                theirs, proof = self._roundtrip(
                    wire.request(Query.AUTH_HELLO, wire.blob(ours)), challenge_and_proof
                )
        except RendezvousStoreGoneError:
            self.close()
            raise _Busy("closed the connection when asked for the token handshake", True) from None
        if token is None:
            if theirs:
                self.close()
                raise RendezvousAuthError(
                    f"the store at {self.where} requires the job's token; give it with {TOKEN_HINT}"
                )
            return  # our server, taking no token: a job without one
        if not theirs or not hmac.compare_digest(
            proof, wire.auth_proof(token, wire.SERVER, ours, theirs)
        ):
            self.close()
            what = "takes no job token" if not theirs else "holds another token than this node"
            raise RendezvousAuthError(
                f"the store at {self.where} {what}: this node's token is not the job's, or "
                "the store is not this job's (an agent given no or another token, or "
                f"something else listening there); give every agent the job's token ({TOKEN_HINT})"
            )
        reply = wire.request(
            Query.AUTH_PROOF, wire.blob(wire.auth_proof(token, wire.CLIENT, ours, theirs))
        )
        try:
            with self._lock:
                self._roundtrip(reply, self._u8)
        except RendezvousStoreGoneError:
            # It proved the same token, so it was not refused: dropped for room (busy).
            self.close()
            raise _Busy("closed the connection during the token handshake") from None

    # --- the Store API -------------------------------------------------------------------

    def set(self, key: str, value: bytes | str, confirmed: bool = False) -> None:
        """``confirmed``: return once the server applied it (``_unanswered``)."""
        payload = wire.request(Query.SET, wire.blob(self._key(key)), wire.blob(_as_bytes(value)))
        self._unanswered(payload, confirmed)

    def get(self, key: str) -> bytes:
        """The value at ``key``, waiting up to ``timeout`` for it to exist (as torch)."""
        wire_key = self._key(key)
        with self._lock:
            self._wait([wire_key], self.timeout, [key])
            return self._roundtrip(wire.request(Query.GET, wire.blob(wire_key)), self._blob)

    def add(self, key: str, amount: int) -> int:
        payload = wire.request(Query.ADD, wire.blob(self._key(key)), wire.I64.pack(amount))
        with self._lock:
            return self._roundtrip(payload, self._i64)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """torch semantics: set ``desired`` if ``key`` holds ``expected``, or is absent and
        ``expected`` is empty; returns the value held afterwards, except that an absent key
        with a non-empty ``expected`` returns ``expected`` (and stays absent)."""
        payload = wire.request(
            Query.COMPARE_SET,
            wire.blob(self._key(key)),
            wire.blob(_as_bytes(expected)),
            wire.blob(_as_bytes(desired)),
        )
        with self._lock:
            return self._roundtrip(payload, self._blob)

    def wait(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> None:
        seconds = self.timeout if timeout is None else timeout.total_seconds()
        wire_keys = [self._key(k) for k in keys]
        with self._lock:
            self._wait(wire_keys, seconds, keys, tick)

    def wait_get(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> list[bytes]:
        """``wait``, then the keys' values (``b""``: a key only a queue holds): in the one
        round trip of a WAIT_GET where the server takes it (``probe_wait_get``), else a
        MULTI_GET after the WAIT."""
        seconds = self.timeout if timeout is None else timeout.total_seconds()
        wire_keys = [self._key(k) for k in keys]
        with self._lock:
            values = self._wait(wire_keys, seconds, keys, tick, self.takes_wait_get)
            if values is None:  # torch's server, or values past the server's reply limit
                values = self._multi_get(wire_keys)
            return values

    def probe_wait_get(self) -> bool:
        """Whether the server answers WAIT_GET (``takes_wait_get``), by an empty one: one
        round trip, to a server of ours only. An older server of ours closes the
        connection instead, and this client is dead (``RendezvousStoreGoneError``)."""
        if self.ours and not self.takes_wait_get:
            with self._lock:
                answer = self._roundtrip(
                    wire.request(Query.WAIT_GET, wire.blobs([])),
                    lambda deadline: (self._u8(deadline), self._u8(deadline)),
                )
            self.takes_wait_get = answer == (wire.STOP_WAITING, wire.VALUES)
        return self.takes_wait_get

    def check(self, keys: Sequence[str]) -> bool:
        payload = wire.request(Query.CHECK, wire.blobs([self._key(k) for k in keys]))
        with self._lock:
            return self._roundtrip(payload, self._u8) == wire.READY

    def delete_key(self, key: str) -> bool:
        payload = wire.request(Query.DELETE_KEY, wire.blob(self._key(key)))
        with self._lock:
            return self._roundtrip(payload, self._i64) == 1

    def multi_get(self, keys: Sequence[str], wait: bool = True) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout`` for all of them (as torch).
        ``wait=False``: one round trip, a missing key reads as ``b""`` (as torch's libuv
        server and ours answer a MULTI_GET that no WAIT preceded)."""
        if not keys:
            return []
        wire_keys = [self._key(k) for k in keys]
        with self._lock:
            if wait:
                self._wait(wire_keys, self.timeout, keys)
            return self._multi_get(wire_keys)

    def _multi_get(self, wire_keys: list[bytes]) -> list[bytes]:
        """One MULTI_GET; caller holds the lock."""
        return self._roundtrip(
            wire.request(Query.MULTI_GET, wire.blobs(wire_keys)),
            lambda deadline: [self._blob(deadline) for _ in wire_keys],
        )

    def multi_set(
        self, keys: Sequence[str], values: Sequence[bytes | str], confirmed: bool = False
    ) -> None:
        """``confirmed``: return once the server applied it (``_unanswered``)."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        payload = wire.multi_set(
            (self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)
        )
        self._unanswered(payload, confirmed)

    def _unanswered(self, payload: bytes, confirmed: bool) -> None:
        """Send a request the protocol does not answer. ``confirmed``: a GETNUMKEYS goes
        with it, in the same send, and its answer proves the server applied the request
        (one connection's requests are applied in order): one round trip."""
        with self._lock:
            if confirmed:
                self._roundtrip(payload + wire.request(Query.GETNUMKEYS), self._i64)
            else:
                self._roundtrip(payload, None)

    def num_keys(self) -> int:
        """Every key the server holds, including ones torch's clients keep for themselves
        (such as ``init/``), as torch's ``num_keys`` does."""
        with self._lock:
            return self._roundtrip(wire.request(Query.GETNUMKEYS), self._i64)

    def __enter__(self) -> TCPStoreClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- protocol ------------------------------------------------------------------------

    @staticmethod
    def _key(key: str) -> bytes:
        return (wire.KEY_PREFIX + key).encode()

    def _wait(
        self,
        wire_keys: list[bytes],
        seconds: float,
        keys: Sequence[str],
        tick: Tick | None = None,
        with_values: bool = False,
    ) -> list[bytes] | None:
        """torch's ``doWait``: park a WAIT on the server; on timeout send CANCEL_WAIT and
        read its answer (after a STOP_WAITING that crossed it, if any), so the stream stays
        in step, then raise. ``tick`` runs every ``WAIT_TICK`` s while the answer is due;
        what it raises leaves the WAIT parked, so the connection is dropped as out of step
        (``_roundtrip``). ``with_values``: a WAIT_GET, and the values that came with its
        answer are returned (None: they would pass the server's reply limit). Caller
        holds the lock."""
        wait_deadline = time.monotonic() + max(seconds, 0.0)

        def values(deadline: float) -> list[bytes] | None:
            """What follows a WAIT_GET's STOP_WAITING (``wire``)."""
            if self._u8(deadline) != wire.VALUES:
                return None
            return [self._blob(deadline) for _ in wire_keys]

        def answer(_: float) -> list[bytes] | None:
            while True:
                due = wait_deadline
                if tick is not None:
                    due = min(due, time.monotonic() + WAIT_TICK)
                try:
                    self._u8(due, wait=True)
                    return values(time.monotonic() + self.timeout) if with_values else None
                except WaitExpired:
                    if tick is None or due >= wait_deadline:
                        raise
                tick()

        query = Query.WAIT_GET if with_values else Query.WAIT
        try:
            return self._roundtrip(wire.request(query, wire.blobs(wire_keys)), answer)
        except WaitExpired:
            pass

        def read_cancel_ack(deadline: float) -> None:
            if self._u8(deadline) == wire.STOP_WAITING:
                if with_values:
                    values(deadline)  # what came with it
                self._u8(deadline)  # the WAIT_CANCELED that follows

        self._roundtrip(wire.request(Query.CANCEL_WAIT), read_cancel_ack)
        raise StoreTimeoutError(
            f"TCPStore {self.where}: timed out after {seconds:.1f}s waiting for {list(keys)}"
        )
