"""An etcd v2 ``CoordinationStore`` (``elastic.core.interfaces.coordination``): the store the
shared round runs over in the ``etcd`` and ``etcd-v2`` backends (``backend.py``).

Keys are base64url-encoded into one path segment each, so ``agent/failures`` and
``agent/failures/3`` never collide as etcd file vs directory; values are base64 because
etcd v2 values are text and store values are bytes. ``add`` and ``compare_set`` are
test-and-set loops on etcd's ``prevIndex``/``prevValue``/``prevExist``, so they are atomic
across every node of the job.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from datetime import timedelta

from elastic.core.interfaces.coordination import WAIT_TICK, Tick
from elastic.core.interfaces.rendezvous import RendezvousConnectionError, RendezvousStateError
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.plugin.extras import needs_extra
from elastic.plugins.rdzv_etcd.client import EtcdClient

with needs_extra("the etcd and etcd-v2 rendezvous backends"):
    import etcd


def _enc_key(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def _enc_value(value: bytes | str) -> str:
    raw = value if isinstance(value, bytes) else value.encode()
    return base64.b64encode(raw).decode()


def _dec_value(text: object) -> bytes:
    """A value as etcd sent it (base64): anything else (a tampered or truncated answer)
    is refused in one line, never a crash."""
    if text is None or text == "":
        return b""
    try:
        if not isinstance(text, str):
            raise TypeError(type(text).__name__)
        return base64.b64decode(text, validate=True)
    except (TypeError, ValueError) as exc:
        raise RendezvousConnectionError(f"etcd sent a value that is not base64: {exc}") from None


def _counter(raw: bytes, path: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise RendezvousStateError(f"etcd key {path!r} holds {raw[:60]!r}, not a counter") from None


class EtcdStore:
    """A store whose keys live in one etcd directory ``directory``; ``sub`` narrows the
    key prefix (``logical``), never the directory, so every key stays one flat entry."""

    def __init__(
        self,
        client: EtcdClient,
        directory: str,
        timeout: timedelta = timedelta(seconds=300),
        *,
        logical: str = "",
        heartbeat_ttl: int = 10,
    ) -> None:
        self.client = client
        self.directory = directory.rstrip("/") + "/"
        self.logical = logical
        self.timeout = timeout
        self.heartbeat_ttl = heartbeat_ttl
        self.where = client.url()

    @property
    def prefix(self) -> str:
        """For messages: the directory and the logical key prefix."""
        return self.directory + self.logical

    def sub(self, prefix: str) -> EtcdStore:
        return EtcdStore(
            self.client,
            self.directory,
            self.timeout,
            logical=self.logical + prefix,
            heartbeat_ttl=self.heartbeat_ttl,
        )

    def _path(self, key: str) -> str:
        return self.directory + _enc_key(self.logical + key)

    def set(self, key: str, value: bytes | str) -> None:
        self.client.call("write", self._path(key), _enc_value(value))

    def heartbeat(self, key: str, value: bytes | str) -> None:
        # A TTL well past the liveness timeout: a dead node's key goes away by itself,
        # but a slow heartbeat thread is judged by staleness, not by a vanished key.
        path, ttl = self._path(key), self.heartbeat_ttl
        self.client.call("write", path, _enc_value(value), ttl=ttl, hedge=True)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """v2 has no multi-key read: one read per key; a missing key reads as ``b""``."""
        return [self._read_or_empty(k) for k in keys]

    def _read_or_empty(self, key: str) -> bytes:
        try:
            return _dec_value(self.client.call("read", self._path(key), hedge=True).value)
        except etcd.EtcdKeyNotFound:
            return b""

    def peer_silence(self) -> None:
        """python-etcd pools its connections: no one connection to ask."""
        return None

    def close(self) -> None:
        self.client.close()

    def get(self, key: str) -> bytes:
        self.wait([key])
        return _dec_value(self.client.call("read", self._path(key)).value)

    def add(self, key: str, amount: int) -> int:
        path = self._path(key)
        if amount == 0:  # a read: no write, no contention
            try:
                return _counter(_dec_value(self.client.call("read", path).value), path)
            except etcd.EtcdKeyNotFound:
                return 0
        while True:
            try:
                current = self.client.call("read", path)
            except etcd.EtcdKeyNotFound:
                try:
                    self.client.call("write", path, _enc_value(str(amount)), prevExist=False)
                    return amount
                except etcd.EtcdAlreadyExist:
                    continue  # someone created it first: add to theirs
            value = _counter(_dec_value(current.value), path) + amount
            try:
                self.client.call(
                    "write", path, _enc_value(str(value)), prevIndex=current.modifiedIndex
                )
                return value
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                continue  # lost the race (or it was deleted): read again

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        path = self._path(key)
        expected_b = expected if isinstance(expected, bytes) else expected.encode()
        desired_b = desired if isinstance(desired, bytes) else desired.encode()
        try:
            if expected_b == b"":
                self.client.call("write", path, _enc_value(desired_b), prevExist=False)
            else:
                self.client.call(
                    "write", path, _enc_value(desired_b), prevValue=_enc_value(expected_b)
                )
            return desired_b
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            pass
        try:
            return _dec_value(self.client.call("read", path).value)
        except etcd.EtcdKeyNotFound:
            return expected_b  # as LocalStore: absent and expected non-empty

    def wait(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> None:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        pending = list(keys)
        while True:
            still: list[str] = []
            for key in pending:
                try:
                    self.client.call("read", self._path(key))
                except etcd.EtcdKeyNotFound:
                    still.append(key)
            if not still:
                return
            pending = still
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(f"timed out after {limit:.1f}s waiting for {pending}")
            # Wake on the first change of a missing key (or after WAIT_TICK, to re-check
            # them all and tick).
            self.client.watch(self._path(pending[0]), None, min(remaining, WAIT_TICK))
            if tick is not None:
                tick()

    def wait_get(
        self, keys: Sequence[str], timeout: timedelta | None = None, tick: Tick | None = None
    ) -> list[bytes]:
        self.wait(keys, timeout, tick)
        return self.multi_get(keys)

    def check(self, keys: Sequence[str]) -> bool:
        for key in keys:
            try:
                self.client.call("read", self._path(key), hedge=True)
            except etcd.EtcdKeyNotFound:
                return False
        return True

    def delete_key(self, key: str) -> bool:
        try:
            self.client.call("delete", self._path(key))
            return True
        except etcd.EtcdKeyNotFound:
            return False
