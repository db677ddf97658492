"""An etcd-backed ``elastic.core.store.Store`` (the job store in ``RendezvousInfo.store``).

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

import etcd
from elastic.core.store import StoreTimeoutError
from elastic.plugins.rdzv_etcd.client import EtcdClient


def _enc_key(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def _enc_value(value: bytes | str) -> str:
    raw = value if isinstance(value, bytes) else value.encode()
    return base64.b64encode(raw).decode()


def _dec_value(text: str | None) -> bytes:
    return base64.b64decode(text or "")


class EtcdStore:
    """A ``Store`` under ``prefix`` (a directory of the run id's subtree)."""

    def __init__(
        self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)
    ) -> None:
        self.client = client
        self.prefix = prefix.rstrip("/") + "/"
        self.timeout = timeout

    def _path(self, key: str) -> str:
        return self.prefix + _enc_key(key)

    def set(self, key: str, value: bytes | str) -> None:
        self.client.call("write", self._path(key), _enc_value(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return _dec_value(self.client.call("read", self._path(key)).value)

    def add(self, key: str, amount: int) -> int:
        path = self._path(key)
        while True:
            try:
                current = self.client.call("read", path)
            except etcd.EtcdKeyNotFound:
                try:
                    self.client.call("write", path, _enc_value(str(amount)), prevExist=False)
                    return amount
                except etcd.EtcdAlreadyExist:
                    continue  # someone created it first: add to theirs
            value = int(_dec_value(current.value)) + amount
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

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
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
            # Wake on the first change of a missing key (or after 1 s, to re-check them all).
            self.client.watch(self._path(pending[0]), None, min(remaining, 1.0))

    def check(self, keys: Sequence[str]) -> bool:
        for key in keys:
            try:
                self.client.call("read", self._path(key))
            except etcd.EtcdKeyNotFound:
                return False
        return True

    def delete_key(self, key: str) -> bool:
        try:
            self.client.call("delete", self._path(key))
            return True
        except etcd.EtcdKeyNotFound:
            return False
