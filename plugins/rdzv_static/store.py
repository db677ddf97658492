"""The TCPStore side of the static backend: hosting or reaching it, and a prefixed view.

torch is imported inside the functions here, never at module level, so that discovering
or importing the plugin stays cheap (``elastic --help`` must not pay for torch).
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from elastic.core.rendezvous import RendezvousConnectionError
from elastic.core.store import StoreTimeoutError

# The store layout, every key under "<run_id>/" (see handler.py's docstring).
ARRIVALS = "rdzv/arrivals"
CLOSED = "rdzv/closed"
LATEST = "rdzv/latest"
JOB = "rdzv/job"
FINISHED = "rdzv/finished"
FINISHED_ALL = "rdzv/finished_all"


def round_key(round_: int, name: str) -> str:
    return f"rdzv/round/{round_}/{name}"


def _first_line(exc: BaseException) -> str:
    # torch's C++ errors carry a multi-line backtrace; users need only the first line.
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _as_text(value: bytes | str) -> str:
    # torch's pybind Store accepts str (and bytes) but returns bytes; keep one type in.
    return value.decode() if isinstance(value, bytes) else value


class PrefixedTorchStore:
    """A ``elastic.core.store.Store`` over a torch store, every key under ``prefix``.

    Rather than torch's ``PrefixStore``, a thin Python wrapper: it lets us translate
    torch's ``DistStoreError`` (a timeout) into ``StoreTimeoutError`` and its
    ``DistNetworkError`` (server gone) into ``RendezvousConnectionError``, which is what
    the agent catches, without the agent ever importing torch.
    """

    def __init__(self, store: Any, prefix: str, timeout: timedelta) -> None:
        self._store = store
        self.prefix = prefix
        self.timeout = timeout

    @property
    def underlying(self) -> Any:
        return self._store

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        from torch.distributed import DistNetworkError, DistStoreError

        try:
            return fn(*args)
        except DistNetworkError as exc:
            raise RendezvousConnectionError(
                f"lost the static rendezvous store during {what}: {_first_line(exc)}"
            ) from None
        except DistStoreError as exc:
            raise StoreTimeoutError(f"store {what}: {_first_line(exc)}") from None

    def set(self, key: str, value: bytes | str) -> None:
        self._call(f"set {key!r}", self._store.set, self._k(key), _as_text(value))

    def get(self, key: str) -> bytes:
        return self._call(f"get {key!r}", self._store.get, self._k(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(f"add {key!r}", self._store.add, self._k(key), amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(
            f"compare_set {key!r}",
            self._store.compare_set,
            self._k(key),
            _as_text(expected),
            _as_text(desired),
        )

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        full = [self._k(k) for k in keys]
        self._call(f"wait {list(keys)}", self._store.wait, full, timeout or self.timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", self._store.check, [self._k(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        return bool(self._call(f"delete {key!r}", self._store.delete_key, self._k(key)))


def poll_for(store: Any, key: str, timeout: timedelta) -> None:
    """Wait for ``key`` by polling ``check``; raise ``StoreTimeoutError`` after ``timeout``.

    Not torch's blocking ``wait``: while the main thread sits in that C++ call, Python
    signal handlers cannot run, so a SIGTERM to the agent would wait out the whole
    rendezvous timeout (600 s by default). Sleeping here keeps the agent interruptible,
    and a time-out logs no C++ warning. The back-off (2 ms growing to 100 ms) keeps a
    key that appears soon -- the usual case -- cheap to notice, and the load on node 0's
    store at about 10 checks a second per waiting node.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    delay = 0.002
    while not store.check([key]):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreTimeoutError(f"{key!r} did not appear within {timeout.total_seconds():g}s")
        time.sleep(min(delay, remaining))
        delay = min(delay * 1.5, 0.1)




def host_store(addr: str, port: int, timeout: timedelta) -> Any:
    """Start the TCPStore server (node rank 0) on ``port``; clear error when it can't."""
    from torch.distributed import DistError, TCPStore

    try:
        # wait_for_workers=False: our own barrier gives a named timeout instead of a
        # constructor that blocks until every node connected.
        return TCPStore(addr, port, None, True, timeout, wait_for_workers=False, multi_tenant=True)
    except (DistError, RuntimeError, OSError) as exc:
        raise RendezvousConnectionError(
            f"node rank 0 cannot host the static rendezvous store on port {port} "
            f"(--master-port): {_first_line(exc)}"
        ) from None


def _wait_reachable(addr: str, port: int, limit: float) -> None:
    """Block until a TCP connection to addr:port succeeds, or raise after ``limit`` seconds.

    torch's own client retries with a back-off that can overshoot its timeout and logs
    a C++ backtrace per try; a plain socket probe keeps the bound and the message ours.
    """
    deadline = time.monotonic() + limit
    delay = 0.05
    last = "no attempt made"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((addr, port), timeout=min(remaining, 2.0)):
                return
        except socket.gaierror as exc:
            raise RendezvousConnectionError(
                f"cannot resolve the static rendezvous master address {addr!r} "
                f"(--master-addr): {exc.strerror or exc}"
            ) from None
        except OSError as exc:
            last = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 1.0)
    raise RendezvousConnectionError(
        f"cannot reach the static rendezvous store at {addr}:{port} (hosted by node rank 0; "
        f"check --master-addr/--master-port and that node 0 is up) within "
        f"{limit:g}s: {last}"
    )


def connect_store(addr: str, port: int, timeout: timedelta) -> Any:
    """Connect to node 0's TCPStore, waiting for it to come up for at most ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    _wait_reachable(addr, port, timeout.total_seconds())
    # torch only once node 0 answers: an unreachable master fails without its ~2 s import.
    from torch.distributed import DistError, TCPStore

    remaining = max(1.0, deadline - time.monotonic())
    try:
        store = TCPStore(addr, port, None, False, timedelta(seconds=remaining))
    except (DistError, RuntimeError, OSError) as exc:
        raise RendezvousConnectionError(
            f"cannot connect to the static rendezvous store at {addr}:{port}: {_first_line(exc)}"
        ) from None
    store.set_timeout(timeout)
    return store
