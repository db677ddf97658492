"""The TCPStore side of the static backend: hosting or reaching it (torch-free, through
``elastic.core.tcpstore``), its keys, reading them, and waiting for keys without blocking
signals.

Store layout, every key under ``<run_id>/`` (values are JSON, never pickle)::

    rdzv/arrivals                   counter: calls to next_rendezvous, all nodes
    rdzv/round/<r>/node/<rank>      {"node_id", "host", "pid"}  (claimed once per rank)
    rdzv/round/<r>/registered       counter: nodes that wrote their node key
    rdzv/round/<r>/complete         true once every node registered (or the closed marker)
    rdzv/round/<r>/assignment       {"round", "master_addr", "master_port", "world_size",
                                     "members"}  (or the closed marker)
    rdzv/job                        {"world_size"}, written by node 0 when it hosts
    rdzv/latest                     the last assignment, with every node's record and time
    rdzv/closed                     true once set_closed was called
    rdzv/finished, rdzv/finished_all   shutdown counter and its "everyone is done" flag
    rdzv/left                       a node that was signalled: the job cannot go on

May import core's ``interfaces`` and ``tcpstore``.
"""

from __future__ import annotations

import errno
import json
import socket
import time
from datetime import timedelta
from typing import Any

from elastic.core.interfaces.rendezvous import RendezvousConnectionError, RendezvousStateError
from elastic.core.interfaces.store import Store, StoreTimeoutError
from elastic.core.tcpstore import TCPStoreServer
from elastic.core.tcpstore.dial import dial
from elastic.core.tcpstore.view import Connection, PrefixStore

# The store layout, every key under "<run_id>/" (see the module).
ARRIVALS = "rdzv/arrivals"
CLOSED = "rdzv/closed"
LATEST = "rdzv/latest"
JOB = "rdzv/job"
FINISHED = "rdzv/finished"
FINISHED_ALL = "rdzv/finished_all"
LEFT = "rdzv/left"  # a node that was signalled: the job cannot go on without it


def round_key(round_: int, name: str) -> str:
    return f"rdzv/round/{round_}/{name}"


def load_json(store: Store, key: str, prefix: str = "") -> Any:
    """Read ``key`` and parse it as JSON; anything else is corrupt state, named as such."""
    raw = store.get(key)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RendezvousStateError(
            f"static rendezvous state is corrupt: key {prefix + key!r} does not hold "
            f"valid JSON ({exc}); value starts {bytes(raw[:40])!r}"
        ) from None


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


def host_store(
    port: int, token: bytes | None = None, agents_keys: bytes | None = None
) -> TCPStoreServer:
    """Start the store server (node rank 0) on ``port`` on every interface, as torchrun's
    static backend does; one clear line when it cannot. With a ``token``, only agents
    that prove it may touch ``agents_keys`` (a key prefix); the workers, torch's clients,
    which cannot, are served everywhere else (``elastic.core.tcpstore.admission``)."""
    try:
        return TCPStoreServer("", port, token=token, members_only=agents_keys if token else None)
    except OSError as exc:
        raise RendezvousConnectionError(
            f"node rank 0 cannot host the static rendezvous store on port {port} "
            f"(--master-port): {exc.strerror or exc}"
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
            with dial(addr, port, min(remaining, 2.0)):
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


def connect_store(
    addr: str, port: int, timeout: timedelta, prefix: str, token: bytes | None = None
) -> PrefixStore:
    """Connect to node 0's store, waiting for it to come up for at most ``timeout``."""
    _wait_reachable(addr, port, timeout.total_seconds())
    conn = Connection(addr, port, timeout.total_seconds(), GONE_HINT, token)
    store = PrefixStore(conn, prefix)
    try:
        store.check([JOB])  # connect now, inside the reachability bound
    except BaseException:
        store.close()
        raise
    return store


GONE_HINT = "node rank 0 hosted it and is gone; a static job cannot go on without it"
