"""A TCPStore connection that reconnects, and a ``CoordinationStore`` view of it under a
key prefix: what the c10d and static backends (and ``elastic status``) use."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from elastic.core.rendezvous import RendezvousConnectionError, RendezvousStoreGoneError
from elastic.core.tcpstore.client import TCPStoreClient


class Connection:
    """One client connection, made again after it broke: a node cut off for a while
    reconnects once the network is back. A store whose host answered that nothing serves
    it any more is final (``RendezvousStoreGoneError``, with ``gone_hint``: what it means
    for the job and what to do about it)."""

    def __init__(self, host: str, port: int, timeout: float, gone_hint: str = "") -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.gone_hint = gone_hint
        self.where = f"{host}:{port}"
        self._client: TCPStoreClient | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _current(self) -> TCPStoreClient:
        with self._lock:
            if self._closed:
                raise RendezvousConnectionError(f"the store client for {self.where} is closed")
            if self._client is None:
                self._client = TCPStoreClient(self.host, self.port, self.timeout)
            return self._client

    def call(self, op: str, *args: Any) -> Any:
        try:
            client = self._current()
            return getattr(client, op)(*args)
        except RendezvousStoreGoneError as exc:
            hint = f"; {self.gone_hint}" if self.gone_hint else ""
            raise RendezvousStoreGoneError(f"lost the rendezvous store: {exc}{hint}") from None
        except RendezvousConnectionError:
            self.reset()
            raise

    def reset(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.reset()


class PrefixStore:
    """A ``CoordinationStore`` view of one connection under a key prefix."""

    def __init__(self, conn: Connection, prefix: str) -> None:
        self._conn = conn
        self.prefix = prefix
        self.where = conn.where

    def sub(self, prefix: str) -> PrefixStore:
        return PrefixStore(self._conn, self.prefix + prefix)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._conn.call("set", self._k(key), value)

    def heartbeat(self, key: str, value: bytes | str) -> None:
        self.set(key, value)  # no leases in TCPStore: liveness is the value changing

    def get(self, key: str) -> bytes:
        return bytes(self._conn.call("get", self._k(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self._conn.call("add", self._k(key), amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self._conn.call("compare_set", self._k(key), expected, desired))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._conn.call("wait", [self._k(k) for k in keys], timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._conn.call("check", [self._k(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        return bool(self._conn.call("delete_key", self._k(key)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """One round trip for many keys (they must exist, or it blocks until timeout)."""
        if not keys:
            return []
        return list(self._conn.call("multi_get", [self._k(k) for k in keys]))

    def close(self) -> None:
        self._conn.close()
