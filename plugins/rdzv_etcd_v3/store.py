"""``EtcdV3Store``: a ``CoordinationStore`` over etcd's v3 API (JSON gateway, see ``client``).

Keys are ``prefix + key`` as UTF-8, values raw bytes, counters ASCII decimal. Every view
made with ``sub`` shares one connection pool and one lease. Operation costs, in round trips:
``set``/``delete_key``/``heartbeat``/``compare_set``/``check``/``multi_get``: one (a txn of
up to 128 ranges: etcd's default ``--max-txn-ops``); ``add``: one to create a counter, two
to bump an existing one, more only under contention (compare-and-swap on mod_revision);
``wait``/``get``: one read, then a watch from that read's revision.

The lease: granted on first use (a ``heartbeat`` or ``add``) with ``lease_ttl`` seconds
(rounded up; etcd may raise it to its minimum), kept alive every third of its TTL from a
daemon thread, revoked by ``close``. When keepalives fail for longer than the TTL (etcd
unreachable, the process stalled) the lease expires and etcd deletes every key written
with ``heartbeat``: the keeper then grants a new lease and increments
``lease_lost_count``. It does not re-write the lost keys: other nodes may already have
acted on their absence, so the round, seeing the count move, decides (rejoin, or give up).

Owns the store's operations and ``store_from_params``. May import ``client``, ``lease``
and ``replies``; core's ``interfaces`` and ``rendezvous.secrets``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from elastic.core.interfaces.coordination import WAIT_TICK, Tick
from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.rendezvous.secrets import read_password
from elastic.plugins.rdzv_etcd_v3.client import (
    DEFAULT_PORT,
    EtcdV3Client,
    LeaseNotFoundError,
    OutcomeUnknown,
    V3Config,
)
from elastic.plugins.rdzv_etcd_v3.lease import Lease
from elastic.plugins.rdzv_etcd_v3.replies import (
    MalformedReply,
    b64,
    reading_reply,
    reply_dict,
    unb64,
)

log = logging.getLogger(__name__)

# --rdzv-conf keys that configure the connection (both backends' TLS spellings).
CONNECTION_KEYS = (
    "protocol",
    "ca_cert",
    "cacert",
    "ssl_cert",
    "cert",
    "ssl_cert_key",
    "key",
    "username",
    "password",
    "password_file",
    "read_timeout",
    "retry_timeout",
)
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _kv(response: object) -> dict[str, Any] | None:
    kvs = reply_dict(response, "response_range").get("kvs")
    if not kvs:
        return None
    if not (isinstance(kvs, list) and isinstance(kvs[0], dict)):
        raise MalformedReply(f"'kvs' is not a list of key-values: {str(kvs)[:60]!r}")
    return kvs[0]


def _range(key: str) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


class _Connection:
    """What every view of one store shares."""

    def __init__(self, client: EtcdV3Client, root: str, lease_ttl: float) -> None:
        self.client = client
        self.lease = Lease(client, lease_ttl)
        self.closed = False
        self.tokens = itertools.count(1)
        self.marker_dir = f"{root}.add/{uuid.uuid4().hex[:12]}/"

    def marker_key(self) -> str:
        # One per thread: its add() calls run one at a time, so the marker's value can
        # only have been written by the call that is looking at it.
        return f"{self.marker_dir}{threading.get_ident()}"


class EtcdV3Store:
    """A ``CoordinationStore`` under ``prefix`` (e.g. ``/elastic/<run_id>/``).

    ``timeout`` bounds ``get`` and a ``wait`` given no timeout. ``close`` on any view
    closes the shared connection and revokes the lease."""

    def __init__(
        self,
        config: V3Config,
        prefix: str,
        *,
        lease_ttl: float = 5.0,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        client = EtcdV3Client(config)
        self._conn = _Connection(client, prefix, lease_ttl)
        self.config = config
        self.prefix = prefix
        self.where = client.where
        self.timeout = timeout

    @property
    def lease_ttl(self) -> int:
        """Seconds a dead client's heartbeat keys outlive it (as granted by etcd)."""
        return self._conn.lease.granted_ttl

    @property
    def lease_lost_count(self) -> int:
        """How many times this connection's lease expired and was replaced."""
        return self._conn.lease.lost_count

    @property
    def lease_id(self) -> int:
        """The current lease (granted now if there is none)."""
        return self._conn.lease.current()

    def sub(self, prefix: str) -> EtcdV3Store:
        view = copy.copy(self)
        view.prefix = self.prefix + prefix
        return view

    def _client(self) -> EtcdV3Client:
        if self._conn.closed:
            raise RendezvousConnectionError(f"the etcd store at {self.where} is closed")
        return self._conn.client

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _read(self, keys: Sequence[str]) -> tuple[dict[str, dict[str, Any]], int]:
        """Full key -> key-value for the keys that exist, and the revision of the read."""
        full = [self._k(k) for k in keys]
        found: dict[str, dict[str, Any]] = {}
        revision = 0
        for start in range(0, len(full), MAX_TXN_OPS):
            chunk = full[start : start + MAX_TXN_OPS]
            reply = self._client().call("kv/txn", {"success": [_range(k) for k in chunk]})
            with reading_reply(self.where, "kv/txn"):
                # A watch from the first chunk's revision sees anything a later chunk missed.
                revision = revision or int(reply_dict(reply, "header")["revision"])
                for key, response in zip(chunk, reply.get("responses", []), strict=True):
                    kv = _kv(response)
                    if kv is not None:
                        found[key] = kv
        return found, revision

    def set(self, key: str, value: bytes | str) -> None:
        self._client().call("kv/put", {"key": b64(self._k(key)), "value": b64(_bytes(value))})

    def heartbeat(self, key: str, value: bytes | str) -> None:
        body = {"key": b64(self._k(key)), "value": b64(_bytes(value))}
        lease = self._conn.lease.current()
        try:
            self._client().call("kv/put", {**body, "lease": str(lease)})
        except LeaseNotFoundError:  # expired before the keeper noticed: nothing was written
            lease = self._conn.lease.replace(lease)
            self._client().call("kv/put", {**body, "lease": str(lease)})

    def get(self, key: str) -> bytes:
        found = self._await([key], None)
        with reading_reply(self.where, "kv/txn"):
            return unb64(found[self._k(key)].get("value"))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values in ``keys`` order, read at one revision when ``keys`` fit one txn. A key
        that does not exist (e.g. a heartbeat whose lease just expired) reads as ``b""``."""
        return self._values(self._read(keys)[0], keys)

    def _values(self, found: dict[str, dict[str, Any]], keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys`` in a read's ``found`` kvs, ``b""`` for one absent."""
        with reading_reply(self.where, "kv/txn"):
            return [unb64(found[k].get("value")) if k in found else b"" for k in map(self._k, keys)]

    def check(self, keys: Sequence[str]) -> bool:
        return len(self._read(keys)[0]) == len(set(keys))

    def wait(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> None:
        self._await(keys, timeout, tick)

    def wait_get(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> list[bytes]:
        return self._values(self._await(keys, timeout, tick), keys)

    def _await(
        self,
        keys: Sequence[str],
        timeout: timedelta | None,
        tick: Tick | None = None,
    ) -> dict[str, dict[str, Any]]:
        limit = (self.timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + limit
        wanted = {self._k(k) for k in keys}
        while True:
            found, revision = self._read(keys)
            missing = wanted - found.keys()
            remaining = deadline - time.monotonic()
            if not missing:
                return found
            if remaining <= 0:
                raise StoreTimeoutError(
                    f"timed out after {limit:.1f}s waiting for {sorted(missing)} in etcd at "
                    f"{self.where}"
                )
            # Watch the span of the missing keys from just after the read that found them
            # missing, so no write in between is lost; then read again to confirm.
            span = sorted(k.encode() for k in missing)
            slice_ = min(remaining, self._client().config.read_timeout)
            if tick is not None:
                slice_ = min(slice_, WAIT_TICK)
            for event in self._client().watch(span[0], span[-1] + b"\0", revision + 1, slice_):
                if event.get("type") != "DELETE":
                    with reading_reply(self.where, "watch"):
                        missing.discard(
                            unb64(reply_dict(event, "kv")["key"]).decode(errors="replace")
                        )
                if not missing:
                    break
            if missing and tick is not None:
                tick()

    def add(self, key: str, amount: int) -> int:
        full = self._k(key)
        if amount == 0:
            return self._counter(self._read([key])[0].get(full), full)
        client, marker = self._client(), self._conn.marker_key()
        # A txn whose reply was lost may or may not have been applied. Each attempt also
        # writes a fresh token to this thread's marker key, in the same txn; any later
        # read showing one of our tokens there proves that attempt applied (exactly once:
        # attempts compare the same mod_revision, or a newer one, so at most one wins).
        outcomes: dict[bytes, int] = {}
        value, mod = 0, 0  # guess "absent" (mod_revision 0): creating costs one round trip
        deadline = time.monotonic() + client.config.retry_timeout
        while True:
            token = str(next(self._conn.tokens)).encode()
            outcomes[token] = value + amount
            lease = self._conn.lease.current()
            txn = {
                "compare": [
                    {"key": b64(full), "target": "MOD", "result": "EQUAL", "mod_revision": mod}
                ],
                "success": [
                    {"request_put": {"key": b64(full), "value": b64(str(value + amount))}},
                    # The marker lives with the lease: a dead client's markers go with it.
                    {"request_put": {"key": b64(marker), "value": b64(token), "lease": str(lease)}},
                ],
                "failure": [_range(full), _range(marker)],
            }
            try:
                reply = client.call("kv/txn", txn, idempotent=False)
            except LeaseNotFoundError:  # rejected as a whole: nothing was written
                self._conn.lease.replace(lease)
                continue
            except OutcomeUnknown as exc:
                if time.monotonic() > deadline:
                    raise RendezvousConnectionError(
                        f"etcd at {client.url} kept failing an add to {full!r}: {exc}"
                    ) from None
                reply = client.call("kv/txn", {"success": [_range(full), _range(marker)]})
            else:
                if reply.get("succeeded"):
                    return value + amount
            with reading_reply(self.where, "kv/txn"):
                kv, mark = (_kv(r) for r in reply["responses"])
                applied = unb64(mark.get("value")) if mark else b""
                if applied in outcomes:
                    return outcomes[applied]
                value, mod = self._counter(kv, full), int(kv["mod_revision"]) if kv else 0

    @staticmethod
    def _counter(kv: dict[str, Any] | None, full: str) -> int:
        raw = unb64(kv.get("value")) if kv else b"0"
        try:
            return int(raw)
        except ValueError:
            raise RendezvousStateError(
                f"etcd key {full!r} holds {raw[:60]!r}, not a counter"
            ) from None

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        full, want, new = b64(self._k(key)), _bytes(expected), _bytes(desired)
        if want:
            compare = {"key": full, "target": "VALUE", "result": "EQUAL", "value": b64(want)}
        else:
            compare = {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        txn = {
            "compare": [compare],
            "success": [{"request_put": {"key": full, "value": b64(new)}}],
            "failure": [{"request_range": {"key": full}}],
        }
        # Retried as is after a lost reply: if the first try applied, this one fails and
        # reads back our own value, which is the right answer.
        reply = self._client().call("kv/txn", txn)
        with reading_reply(self.where, "kv/txn"):
            if reply.get("succeeded"):
                return new
            kv = _kv(reply["responses"][0])
            return unb64(kv.get("value")) if kv else want

    def delete_key(self, key: str) -> bool:
        reply = self._client().call("kv/deleterange", {"key": b64(self._k(key))})
        with reading_reply(self.where, "kv/deleterange"):
            return int(reply.get("deleted", 0)) > 0

    def peer_silence(self) -> None:
        """Requests go through a pool of HTTP connections: no one connection to ask."""
        return None

    def close(self) -> None:
        if self._conn.closed:
            return
        self._conn.lease.close()
        self._conn.closed = True
        self._conn.client.close()


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    value = params.get_as_float(key)
    return default if value is None else value


def store_from_params(
    params: RendezvousParameters,
    prefix: str,
    lease_ttl: float,
    max_attempt: float | None = None,
    hedge_after: float | None = None,
) -> EtcdV3Store:
    """A store for ``--rdzv-endpoint h1:2379,h2:2379`` and the ``CONNECTION_KEYS`` of
    ``--rdzv-conf`` (``https://`` in the endpoint implies ``protocol=https``). Unknown
    keys are the caller's to reject. ``max_attempt`` caps ``read_timeout``: how long one
    request may wait on one member before it is retried on the next; ``hedge_after``:
    ``V3Config``'s."""
    endpoint = params.endpoint or f"127.0.0.1:{DEFAULT_PORT}"
    config = V3Config(
        endpoint=endpoint,
        protocol=params.get("protocol") or ("https" if "https://" in endpoint else "http"),
        ca_cert=params.get("ca_cert") or params.get("cacert"),
        cert=params.get("ssl_cert") or params.get("cert"),
        key=params.get("ssl_cert_key") or params.get("key"),
        username=params.get("username"),
        password=read_password(params),  # or password_file, or the environment
        read_timeout=min(_seconds(params, "read_timeout", 10.0), max_attempt or math.inf),
        retry_timeout=_seconds(params, "retry_timeout", 30.0),
        hedge_after=hedge_after,
    )
    return EtcdV3Store(config, prefix, lease_ttl=lease_ttl)
