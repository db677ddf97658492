"""Hosting or reaching the job's ``torch.distributed.TCPStore``, and a key-prefixing view.

torch is imported inside functions only: importing this plugin must stay cheap, and only
creating a handler pays for torch.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from elastic.core import net
from elastic.core.rendezvous import (
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousStoreGoneError,
)
from elastic.core.store import StoreTimeoutError

log = logging.getLogger(__name__)

DEFAULT_PORT = 29400

T = TypeVar("T")


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``host[:port]`` or ``[v6addr]:port`` -> (host, port)."""
    if not endpoint.strip():
        raise RendezvousConfigError("the c10d backend needs --rdzv-endpoint=HOST[:PORT]")
    try:
        host, port = net.parse_endpoint(endpoint, default_port)
    except ValueError as exc:
        raise RendezvousConfigError(f"--rdzv-endpoint {exc}") from None
    if not port:
        raise RendezvousConfigError(f"--rdzv-endpoint {endpoint!r}: port 0; give a real port")
    return host, port


def resolve(host: str, port: int) -> list[tuple[int, str]]:
    try:
        return net.resolve(host, port)
    except OSError as exc:
        raise RendezvousConnectionError(f"cannot resolve rendezvous host {host!r}: {exc}") from None


def try_listen(host: str, port: int) -> socket.socket | None:
    """A listening socket on the endpoint's own address, or None when this machine cannot
    host it (the address is not ours, or another agent here already listens on it)."""
    for family, addr in resolve(host, port):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # REUSEADDR only lets us past TIME_WAIT leftovers; a live listener still wins.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
            sock.listen(1024)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise
    return None


def host_store(sock: socket.socket, host: str, port: int, timeout: float) -> Any:
    """Serve a TCPStore on an already bound socket, so it listens on that address only
    (TCPStore's own master binds every interface)."""
    from torch.distributed import TCPStore

    fd = sock.detach()  # the store owns the descriptor from here on
    return TCPStore(
        host,
        port,
        None,
        True,
        timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=fd,
        use_libuv=True,
    )


def probe(host: str, port: int, timeout: float = 3.0) -> None:
    """Fail at once when nothing listens: for readers (``elastic status``), which never
    wait for a host to appear, and need not pay for importing torch to learn it."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {host}:{port}: {exc.strerror or exc}"
        ) from None


def connect_store(host: str, port: int, timeout: float) -> Any:
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, None, False, timedelta(seconds=timeout), use_libuv=True)
    except Exception as exc:  # DistNetworkError / RuntimeError from the C++ client
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {host}:{port}: {first_line(exc)}"
        ) from None


# What torch's client says when the server's host answered that nothing serves it.
GONE_WORDS = ("refused", "reset by peer", "broken pipe", "connection closed", "eof")


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def is_timeout(exc: BaseException) -> bool:
    """torch raises DistStoreError for a wait/get that timed out, DistNetworkError (and
    plain RuntimeError) when the connection is gone."""
    name = type(exc).__name__
    return name == "DistStoreError" or "timeout" in str(exc).lower() and name != "DistNetworkError"


class PrefixStore:
    """A ``Store`` view adding a key prefix and turning torch's errors into ours:
    ``StoreTimeoutError`` for timeouts, ``RendezvousConnectionError`` for a lost store."""

    def __init__(self, store: Any, prefix: str, where: str) -> None:
        self._store = store
        self.prefix = prefix
        self.where = where  # "host:port", for messages

    def sub(self, prefix: str) -> PrefixStore:
        return PrefixStore(self._store, self.prefix + prefix, self.where)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:
            if is_timeout(exc):
                raise StoreTimeoutError(first_line(exc)) from None
            line = first_line(exc)
            gone = any(w in line.lower() for w in GONE_WORDS)
            error = RendezvousStoreGoneError if gone else RendezvousConnectionError
            raise error(
                f"lost the rendezvous store at {self.where} (did the hosting agent die?): {line}"
            ) from None

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._call(self._store.set, self._k(key), value)

    def get(self, key: str) -> bytes:
        return self._call(self._store.get, self._k(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self._store.add, self._k(key), amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(self._store.compare_set, self._k(key), expected, desired)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        full = [self._k(k) for k in keys]
        if timeout is None:
            self._call(self._store.wait, full)
        else:
            self._call(self._store.wait, full, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call(self._store.check, [self._k(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        return bool(self._call(self._store.delete_key, self._k(key)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """One round trip for many keys (they must exist, or it blocks until timeout)."""
        if not keys:
            return []
        return list(self._call(self._store.multi_get, [self._k(k) for k in keys]))

    def heartbeat(self, key: str, value: bytes | str) -> None:
        self.set(key, value)  # no leases in TCPStore: liveness is the value changing

    def close(self) -> None:
        """The connection closes with its last reference (torch's client has no close)."""
