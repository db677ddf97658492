"""Hosting or reaching the job's TCPStore, and the ``CoordinationStore`` view over it.

The store speaks torch's TCPStore wire protocol through ``elastic.core.tcpstore``, so an
agent never imports torch, and an endpoint served by torch's own ``TCPStore(...,
is_master=True)`` (a standalone rendezvous service) works as well.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import TypeVar

from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousConnectionError
from elastic.core.rendezvous import net
from elastic.core.tcpstore import TCPStoreServer

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
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {host}:{port}: {exc.strerror or exc}"
        ) from None


GONE_HINT = (
    "the agent hosting the c10d store is gone, and a c10d job cannot outlive it (for a job "
    "with no single point of failure use --rdzv-backend=etcd-v3)"
)
