"""torch's TCPStore wire protocol, as spoken by torch 2.13 (``TCPStore.cpp``,
``TCPStoreBackend.hpp``, ``TCPStoreLibUvBackend.cpp``).

A request is one query-type byte followed by its fields; a response has no header, its
shape is implied by the request. Integers are fixed-width little endian (torch writes its
native byte order, which is little endian on every platform it ships for). Strings and
byte vectors are a ``u64`` length followed by the bytes. A connection's first request
must be ``VALIDATE`` with the magic number; torch's client then sends ``PING`` with a
nonce the server echoes, to know the peer really is a store.

Keys on the wire are whatever the client sends: torch's client prefixes every key with
``/`` (``TCPStore::keyPrefix_``), so a client meant to share keys with torch's must too.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

VALIDATION_MAGIC = 0x3C85F7CE
KEY_PREFIX = "/"

# torch's libuv server (the default one) refuses requests beyond these; ours does the
# same, so a request either server accepts is accepted by both.
MAX_KEY_LEN = 8 * 1024
MAX_VALUE_LEN = 8 * 1024 * 1024
MAX_KEY_COUNT = 128 * 1024

U8 = struct.Struct("<B")
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
U64 = struct.Struct("<Q")


class Query(enum.IntEnum):
    """``c10d::detail::QueryType``: the value is the position in torch's enum. The
    queue, list and barrier queries (14-18) and APPEND (9) are not served here."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13


# One-byte responses (CheckResponseType, WaitResponseType).
READY, NOT_READY = 0, 1
STOP_WAITING, WAIT_CANCELED = 0, 1


class ProtocolError(ValueError):
    """The bytes are not a valid request (unknown query, a length beyond the limits)."""


class Incomplete(Exception):
    """The buffer does not hold a whole request yet."""


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


class Reader:
    """Reads fields from the front of a buffer; ``Incomplete`` when it runs out, so the
    caller can retry the whole request once more bytes arrived."""

    def __init__(self, buf: bytes | bytearray, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def _take(self, fmt: struct.Struct) -> int:
        end = self.pos + fmt.size
        if end > len(self.buf):
            raise Incomplete
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos = end
        return int(value)

    def u8(self) -> int:
        return self._take(U8)

    def u32(self) -> int:
        return self._take(U32)

    def i64(self) -> int:
        return self._take(I64)

    def count(self) -> int:
        n = self._take(U64)
        if n > MAX_KEY_COUNT:
            raise ProtocolError(f"{n} keys in one request (max {MAX_KEY_COUNT})")
        return n

    def blob(self, limit: int) -> bytes:
        # Check the declared length before waiting for it: a garbage length fails now
        # instead of making the server buffer up to it.
        n = self._take(U64)
        if n > limit:
            raise ProtocolError(f"a field of {n} bytes (max {limit})")
        end = self.pos + n
        if end > len(self.buf):
            raise Incomplete
        data = bytes(self.buf[self.pos : end])
        self.pos = end
        return data

    def key(self) -> bytes:
        return self.blob(MAX_KEY_LEN)

    def value(self) -> bytes:
        return self.blob(MAX_VALUE_LEN)

    def keys(self) -> list[bytes]:
        return [self.key() for _ in range(self.count())]


@dataclass(frozen=True)
class Request:
    """One parsed request; the fields its query does not have keep their defaults."""

    query: Query
    key: bytes = b""
    value: bytes = b""  # SET's value; COMPARE_SET's expected value
    desired: bytes = b""  # COMPARE_SET's new value
    number: int = 0  # ADD's amount; VALIDATE's magic; PING's nonce
    keys: tuple[bytes, ...] = ()  # CHECK, WAIT, MULTI_GET
    pairs: tuple[tuple[bytes, bytes], ...] = ()  # MULTI_SET


def parse_request(reader: Reader) -> Request:
    """Parse one request, consuming it from ``reader``."""
    code = reader.u8()
    try:
        query = Query(code)
    except ValueError:
        raise ProtocolError(f"unknown or unsupported query type {code}") from None
    if query in (Query.VALIDATE, Query.PING):
        return Request(query, number=reader.u32())
    if query in (Query.GET, Query.DELETE_KEY):
        return Request(query, key=reader.key())
    if query is Query.SET:
        return Request(query, key=reader.key(), value=reader.value())
    if query is Query.COMPARE_SET:
        return Request(query, key=reader.key(), value=reader.value(), desired=reader.value())
    if query is Query.ADD:
        return Request(query, key=reader.key(), number=reader.i64())
    if query in (Query.CHECK, Query.WAIT, Query.MULTI_GET):
        return Request(query, keys=tuple(reader.keys()))
    if query is Query.MULTI_SET:
        pairs = tuple((reader.key(), reader.value()) for _ in range(reader.count()))
        return Request(query, pairs=pairs)
    return Request(query)  # GETNUMKEYS, CANCEL_WAIT: no fields
