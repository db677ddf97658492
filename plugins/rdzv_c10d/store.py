"""Hosting or reaching the job's TCPStore, and the ``CoordinationStore`` view over it.

The store speaks torch's TCPStore wire protocol through ``elastic.core.tcpstore``, so an
agent never imports torch, and an endpoint served by torch's own ``TCPStore(...,
is_master=True)`` (a standalone rendezvous service) works as well.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousConnectionError
from elastic.core.rendezvous import net
from elastic.core.tcpstore import TCPStoreServer
from elastic.core.tcpstore.dial import dial
from elastic.core.tcpstore.view import Connection

log = logging.getLogger(__name__)

DEFAULT_PORT = 29400
FIRST_CONTACT_PAUSE = 0.2  # s between attempts to reach a store that is not up yet
FIRST_CONTACT_QUIET = 3.0  # s of waiting that are normal (the hosting agent is starting)

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


def parse_endpoints(endpoint: str) -> list[tuple[str, int]]:
    """``h0[:port],h1[:port],...``: the hosts that may serve the store, first the one
    that hosts it at start; each may take it over (and a joiner finds it there)."""
    found = [parse_endpoint(one.strip()) for one in endpoint.split(",")]
    return list(dict.fromkeys(found))


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


def host_store(sock: socket.socket, token: bytes | None = None) -> TCPStoreServer:
    """Serve the store on an already bound socket, so it listens on that address only;
    with the job token, only to clients that prove it."""
    return TCPStoreServer(sock=sock, token=token)


def probe(host: str, port: int, timeout: float = 3.0) -> None:
    """Fail at once when nothing listens: for readers (``elastic status``), which never
    wait for a host to appear."""
    try:
        dial(host, port, timeout).close()
    except OSError as exc:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {host}:{port}: {exc.strerror or exc}"
        ) from None


GONE_HINT = (
    "the agent hosting the c10d store is gone, and a c10d job cannot outlive it (for a job "
    "with no single point of failure use --rdzv-backend=etcd-v3)"
)


def first_contact(
    conn: Connection, prefix: str, limit: float, try_hosting: Callable[[], bool]
) -> None:
    """Connect now (fail early, and not inside a round), waiting for a store that is not
    up yet: agents of one job start at the same time on their machines, and the one that
    hosts the store may well be the last to listen. Before we ever reached it, "connection
    refused" means "not started yet", not "gone"; after that, it is final (the monitor
    thread's ``RendezvousStoreGoneError``). Bounded by ``limit`` (``read_timeout``: as
    torch's TCPStore client, which retries a refused connect until its timeout).

    While nobody listens, ``try_hosting`` is asked again to take the endpoint: the agent
    that won it may have died before listening, or something else held the port for a
    moment; whoever can listen on the endpoint hosts, whenever that becomes possible."""
    started = time.monotonic()
    deadline = started + limit
    told = False
    while True:
        try:
            conn.call("check", [prefix])
            return
        except RendezvousConnectionError as exc:  # refused (StoreGone) or no answer
            if try_hosting():
                continue
            if time.monotonic() + FIRST_CONTACT_PAUSE >= deadline:
                raise RendezvousConnectionError(
                    f"the c10d store at {conn.where} did not come up within "
                    f"read_timeout={limit:g}s: {exc}"
                ) from None
            if not told and time.monotonic() - started >= FIRST_CONTACT_QUIET:
                log.warning(
                    "waiting for the c10d store at %s to come up (%s); retrying for up "
                    "to read_timeout=%gs",
                    conn.where,
                    str(exc).split(";")[0],
                    limit,
                )
                told = True
            time.sleep(FIRST_CONTACT_PAUSE)
