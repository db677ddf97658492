"""torch's TCPStore wire protocol, as spoken by torch 2.13 and 2.14 (``TCPStore.cpp``,
``TCPStoreBackend.hpp``, ``TCPStoreLibUvBackend.cpp``).

A request is one query-type byte followed by its fields; a response has no header, its
shape is implied by the request. Integers are fixed-width little endian (torch writes its
native byte order, which is little endian on every platform it ships for). Strings and
byte vectors are a ``u64`` length followed by the bytes. A connection's first request
must be ``VALIDATE`` with the magic number; torch's client then sends ``PING`` with a
nonce the server echoes, to know the peer really is a store.

Ours alone: two queries torch's enum does not have (``AUTH_HELLO``, ``AUTH_PROOF``), by
which each side proves to the other that it holds the job token, without sending it.
``AUTH_HELLO`` carries the client's fresh random challenge; the server answers with its
own and its proof over both (``auth_proof(token, SERVER, ...)``; two empty fields when it
takes no token). Only once that proof checks out does the client send ``AUTH_PROOF``,
its own proof over both challenges, answered with ``AUTHENTICATED``: a listener without
the token learns nothing it could use elsewhere, and cannot pass for the job's store.
torch's servers close a connection that sends ``AUTH_HELLO`` (an unknown query).

Ours alone too: ``WAIT_GET``, a ``WAIT`` whose ``STOP_WAITING`` brings the keys' values
along, so a waiter reads what it waited for in the same round trip. The values follow as
a ``MULTI_GET`` answers them, after ``VALUES``; or ``NO_VALUES`` alone when they would pass
the server's reply limit (the client then reads them with ``MULTI_GET``, which the limit
governs as always). A ``CANCEL_WAIT`` that crosses the ``STOP_WAITING`` is answered after
it and its values. A client sends it only to a server that answered an empty one
(``STOP_WAITING``, ``VALUES``): an older server of ours closes the connection instead.

Keys on the wire are whatever the client sends: torch's client prefixes every key with
``/`` (``TCPStore::keyPrefix_``), so a client meant to share keys with torch's must too.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Generator, Iterable, Sequence
from typing import NamedTuple, TypeVar

VALIDATION_MAGIC = 0x3C85F7CE
KEY_PREFIX = "/"

# torch's libuv server (the default one) refuses requests beyond these; ours does the
# same, so a request either server accepts is accepted by both.
MAX_KEY_LEN = 8 * 1024
MAX_VALUE_LEN = 8 * 1024 * 1024
MAX_KEY_COUNT = 128 * 1024
# Ours alone: a cap on one whole request, which the limits above leave at terabytes (a
# MULTI_SET of 128Ki 8 MiB values). Room for a MULTI_SET of a few full-size values.
MAX_REQUEST_LEN = 64 * 1024 * 1024
# The only request a connection may send before it is validated: VALIDATE itself.
VALIDATE_LEN = 1 + 4

U8 = struct.Struct("<B")
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
U64 = struct.Struct("<Q")

T = TypeVar("T")


class Query(enum.IntEnum):
    """``c10d::detail::QueryType``: the value is the position in torch's enum (every
    query torch 2.13's and 2.14's clients send; ``requests`` answers them)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18
    # Ours, far from torch's numbers: the token handshake (see the module).
    AUTH_HELLO = 96
    AUTH_PROOF = 97
    WAIT_GET = 98  # a WAIT answered with the keys' values (see the module)


# One-byte responses (CheckResponseType, WaitResponseType; AUTH_PROOF's).
READY, NOT_READY = 0, 1
AUTHENTICATED = 0
AUTH_CHALLENGE_LEN = 32
MAX_AUTH_LEN = 64  # an AUTH_PROOF's field: a SHA-256 HMAC is 32 bytes
# The largest request before the token is proved (AUTH_HELLO or AUTH_PROOF: query,
# length, field), so a stranger past VALIDATE cannot make the server buffer more.
AUTH_REQUEST_LEN = 1 + 8 + MAX_AUTH_LEN
STOP_WAITING, WAIT_CANCELED = 0, 1
NO_VALUES, VALUES = 0, 1  # what follows a WAIT_GET's STOP_WAITING


class ProtocolError(ValueError):
    """The bytes are not a valid request (unknown query, a length beyond the limits)."""


class RequestTooLarge(ProtocolError):
    """A request beyond the parser's ``max_len``: the peer is refused, not just wrong."""


# --- encoding (both sides) -------------------------------------------------------------


def blob(data: bytes) -> bytes:
    """A length-prefixed string or byte vector."""
    return U64.pack(len(data)) + data


def blobs(items: Sequence[bytes]) -> bytes:
    """A count followed by that many blobs (CHECK, WAIT, MULTI_GET)."""
    return U64.pack(len(items)) + b"".join(blob(item) for item in items)


def request(query: Query, *fields: bytes) -> bytes:
    return U8.pack(query) + b"".join(fields)


def handshake(nonce: int) -> bytes:
    """VALIDATE and PING in one write, as torch's client sends them."""
    return request(Query.VALIDATE, U32.pack(VALIDATION_MAGIC)) + request(
        Query.PING, U32.pack(nonce)
    )


SERVER, CLIENT = b"server", b"client"  # whose proof: one side's is never the other's


def auth_proof(
    token: bytes, side: bytes, client_challenge: bytes, server_challenge: bytes
) -> bytes:
    """What proves the token for this pair of challenges; the token never crosses the wire."""
    message = b"elastic-tcpstore-auth/2\n" + side + b"\n" + client_challenge + server_challenge
    return hmac.new(token, message, hashlib.sha256).digest()


def multi_set(pairs: Iterable[tuple[bytes, bytes]]) -> bytes:
    items = list(pairs)
    # torch's client writes this count as int64, unlike the u64 of CHECK/WAIT/MULTI_GET;
    # the bytes are the same for any count that can occur.
    return request(
        Query.MULTI_SET,
        I64.pack(len(items)),
        *(blob(key) + blob(value) for key, value in items),
    )


# --- decoding (the server) ---------------------------------------------------------------


class Request(NamedTuple):
    """One parsed request; the fields its query does not have keep their defaults. A named
    tuple: made for every request the store serves, and not compiled at each import as a
    dataclass's methods are (see AttemptEnd in core/agent/outcome.py)."""

    query: Query
    key: bytes = b""
    value: bytes = b""  # SET's, APPEND's, QUEUE_PUSH's value; COMPARE_SET's expected value
    desired: bytes = b""  # COMPARE_SET's new value
    number: int = 0  # ADD's amount; BARRIER's world size; VALIDATE's magic; PING's nonce
    keys: tuple[bytes, ...] = ()  # CHECK, WAIT, MULTI_GET, WAIT_GET
    pairs: tuple[tuple[bytes, bytes], ...] = ()  # MULTI_SET


Parsing = Generator[None, None, T]


class _Counted:
    """A field that is a u64 count followed by that many keys (``pairs``: key, value)."""

    def __init__(self, pairs: bool) -> None:
        self.pairs = pairs


_KEYS, _PAIRS = _Counted(pairs=False), _Counted(pairs=True)
# What follows each query byte, in order: (its field in ``Request``, how it is written: a
# fixed-width integer, a blob of at most that many bytes, or counted keys or pairs). The
# one description of the requests, read by both ways of parsing them below.
Field = tuple[str, "struct.Struct | int | _Counted"]
_LAYOUT: dict[int, tuple[Query, tuple[Field, ...]]] = {}
for _queries, _fields in (
    ((Query.VALIDATE, Query.PING), (("number", U32),)),
    ((Query.AUTH_HELLO, Query.AUTH_PROOF), (("value", MAX_AUTH_LEN),)),
    ((Query.GET, Query.DELETE_KEY, Query.QUEUE_POP, Query.QUEUE_LEN), (("key", MAX_KEY_LEN),)),
    (
        (Query.SET, Query.APPEND, Query.QUEUE_PUSH),
        (("key", MAX_KEY_LEN), ("value", MAX_VALUE_LEN)),
    ),
    (
        (Query.COMPARE_SET,),
        (("key", MAX_KEY_LEN), ("value", MAX_VALUE_LEN), ("desired", MAX_VALUE_LEN)),
    ),
    ((Query.ADD, Query.BARRIER), (("key", MAX_KEY_LEN), ("number", I64))),
    ((Query.CHECK, Query.WAIT, Query.MULTI_GET, Query.WAIT_GET), (("keys", _KEYS),)),
    ((Query.MULTI_SET,), (("pairs", _PAIRS),)),
    ((Query.GETNUMKEYS, Query.CANCEL_WAIT, Query.LIST_KEYS), ()),
):
    for _query in _queries:
        _LAYOUT[_query.value] = (_query, _fields)


def _layout(code: int) -> tuple[Query, tuple[Field, ...]]:
    found = _LAYOUT.get(code)
    if found is None:
        raise ProtocolError(f"unknown or unsupported query type {code}")
    return found


class _Short(Exception):
    """The bytes buffered end inside the request."""


class RequestParser:
    """Cuts a connection's byte stream into requests. Incremental: a request that
    arrives in pieces is parsed where it stopped, never again from its start, so the
    work is linear in the bytes however they are cut (re-parsing a large MULTI_SET on
    every piece would be quadratic). A request over ``max_len`` bytes is refused as soon
    as its declared lengths say so, before its bytes are buffered; the server lowers
    ``max_len`` to ``VALIDATE_LEN`` until a connection is validated.

    A request already buffered whole (almost every one) is read straight from the
    buffer (``_whole``); only one cut short is parsed by a generator that stops where
    the bytes end (``_request``): a generator's every step costs several times more."""

    def __init__(self, max_len: int = MAX_REQUEST_LEN) -> None:
        self.max_len = max_len
        self._buf = bytearray()
        self._pos = 0  # what _buf holds before this is consumed
        self._taken = 0  # bytes of the request being parsed consumed so far
        self._pending: Parsing[Request] | None = None

    def feed(self, data: bytes) -> None:
        # Compacting here, once per read, rather than per request keeps many small
        # requests in one read linear too.
        del self._buf[: self._pos]
        self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet consumed."""
        return len(self._buf) - self._pos

    @property
    def partial(self) -> bool:
        """Whether part of a request was received and the rest is still to come."""
        return self._pending is not None or self.buffered > 0

    def next(self) -> Request | None:
        """The next whole request, or ``None`` until more bytes are fed."""
        if self._pending is None:
            if not self.buffered:
                return None
            whole = self._whole()
            if whole is not None:
                return whole
            # Cut short: parsed from its start once more, then where each piece ends.
            self._pending = self._request()
            self._taken = 0
        try:
            next(self._pending)  # runs until it needs bytes not fed yet
        except StopIteration as done:
            self._pending = None
            return done.value
        return None

    # -- a request buffered whole --------------------------------------------------------
    def _whole(self) -> Request | None:
        """The request at ``_pos`` if the buffer holds all of it (consumed), else None
        (nothing consumed). Raises as ``_request`` does, at the same field."""
        try:
            code, pos = self._fixed(self._pos, U8)
            query, layout = _layout(code)
            fields: dict[str, object] = {}
            for name, kind in layout:
                if isinstance(kind, struct.Struct):
                    fields[name], pos = self._fixed(pos, kind)
                elif isinstance(kind, int):
                    fields[name], pos = self._bytes(pos, kind)
                else:
                    fields[name], pos = self._counted(pos, kind)
        except _Short:
            return None
        self._pos = pos
        return Request(query, **fields)  # type: ignore[arg-type]

    def _check(self, end: int) -> None:
        if end - self._pos > self.max_len:
            raise RequestTooLarge(f"a request over {self.max_len} bytes")
        if end > len(self._buf):
            raise _Short

    def _fixed(self, pos: int, fmt: struct.Struct) -> tuple[int, int]:
        self._check(pos + fmt.size)
        return int(fmt.unpack_from(self._buf, pos)[0]), pos + fmt.size

    def _bytes(self, pos: int, limit: int) -> tuple[bytes, int]:
        n, pos = self._fixed(pos, U64)
        if n > limit:
            raise ProtocolError(f"a field of {n} bytes (max {limit})")
        self._check(pos + n)
        return bytes(self._buf[pos : pos + n]), pos + n

    def _counted(self, pos: int, kind: _Counted) -> tuple[tuple[object, ...], int]:
        count, pos = self._fixed(pos, U64)
        if count > MAX_KEY_COUNT:
            raise ProtocolError(f"{count} keys in one request (max {MAX_KEY_COUNT})")
        items: list[object] = []
        for _ in range(count):
            key, pos = self._bytes(pos, MAX_KEY_LEN)
            if kind.pairs:
                value, pos = self._bytes(pos, MAX_VALUE_LEN)
                items.append((key, value))
            else:
                items.append(key)
        return tuple(items), pos

    # -- a request cut short ----------------------------------------------------------------
    def _take(self, n: int) -> Parsing[bytes]:
        if self._taken + n > self.max_len:
            raise RequestTooLarge(f"a request over {self.max_len} bytes")
        while self.buffered < n:
            yield
        data = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        self._taken += n
        return data

    def _int(self, fmt: struct.Struct) -> Parsing[int]:
        return int(fmt.unpack((yield from self._take(fmt.size)))[0])

    def _blob(self, limit: int) -> Parsing[bytes]:
        # The declared length is checked before waiting for it: a garbage length fails
        # now instead of making the server buffer up to it.
        n = yield from self._int(U64)
        if n > limit:
            raise ProtocolError(f"a field of {n} bytes (max {limit})")
        return (yield from self._take(n))

    def _request(self) -> Parsing[Request]:
        query, layout = _layout((yield from self._int(U8)))
        fields: dict[str, object] = {}
        for name, kind in layout:
            if isinstance(kind, struct.Struct):
                fields[name] = yield from self._int(kind)
            elif isinstance(kind, int):
                fields[name] = yield from self._blob(kind)
            else:
                count = yield from self._int(U64)
                if count > MAX_KEY_COUNT:
                    raise ProtocolError(f"{count} keys in one request (max {MAX_KEY_COUNT})")
                items: list[object] = []
                for _ in range(count):
                    key = yield from self._blob(MAX_KEY_LEN)
                    items.append(
                        (key, (yield from self._blob(MAX_VALUE_LEN))) if kind.pairs else key
                    )
                fields[name] = tuple(items)
        return Request(query, **fields)  # type: ignore[arg-type]
