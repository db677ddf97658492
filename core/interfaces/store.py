"""The key-value store interface that rendezvous backends hand to the agent.

It is the subset of ``torch.distributed.Store`` the agent needs, so a
``torch.distributed.TCPStore`` satisfies it as is; ``LocalStore`` is the in-process
implementation used by the standalone (single node) launch, which never imports torch.
Values are bytes; everything the project itself stores is JSON.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol, runtime_checkable


class StoreTimeoutError(TimeoutError):
    """A ``wait`` or ``get`` did not see its keys before the timeout."""


@runtime_checkable
class Store(Protocol):
    def set(self, key: str, value: bytes | str) -> None: ...

    def get(self, key: str) -> bytes:
        """Block until ``key`` exists (up to the store's timeout) and return its value."""
        ...

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); return it."""
        ...

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: if absent).

        Returns the value held afterwards, so the caller won when it equals ``desired``.
        """
        ...

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None: ...

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists; never blocks."""
        ...

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values in ``keys`` order, ``b""`` for a key that does not exist; never blocks.
        A counter reads as its decimal text. One round trip where the server allows."""
        ...

    def delete_key(self, key: str) -> bool: ...


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class LocalStore:
    """A thread-safe in-memory ``Store`` for agents that need no server."""

    def __init__(self, timeout: timedelta = timedelta(seconds=300)) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self.timeout = timeout

    def set(self, key: str, value: bytes | str) -> None:
        with self._cond:
            self._data[key] = _as_bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        expected_b, desired_b = _as_bytes(expected), _as_bytes(desired)
        with self._cond:
            current = self._data.get(key)
            if (current is None and expected_b == b"") or current == expected_b:
                self._data[key] = desired_b
                self._cond.notify_all()
                return desired_b
            return current if current is not None else expected_b

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        with self._cond:
            while not all(k in self._data for k in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [k for k in keys if k not in self._data]
                    raise StoreTimeoutError(f"timed out after {limit:.1f}s waiting for {missing}")
                self._cond.wait(remaining)

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with self._cond:
            return [self._data.get(k, b"") for k in keys]

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None
