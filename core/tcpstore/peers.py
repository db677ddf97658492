"""One connection ``TCPStoreServer`` serves: its state (``Peer``: the handshake, the
token, the parked WAIT, its buffers and deadline) and the moving of its bytes (``recv``,
``send``, which selector events it wants), and the listening socket the server opens.

A peer that sends faster than it reads stops being read (TCP pushes back on it) once its
unread answers pass ``OUT_HIGH_WATER``.

May import ``limits``, ``store`` (the errors that drop a connection) and ``wire``.
"""

from __future__ import annotations

import selectors
import socket
import time

from elastic.core.tcpstore import limits, wire
from elastic.core.tcpstore.store import Drop

# One round of the loop answers at most this much of a connection's pipelined requests,
# so a client flooding requests delays the others by that much work (~ms), not more.
RECV_SIZE = 64 * 1024
OUT_HIGH_WATER = 4 * 1024 * 1024


def listening_socket(host: str, port: int, sock: socket.socket | None) -> socket.socket:
    """A socket listening on ``host:port`` (``host=""``: every interface, as torch's), or
    ``sock``, already bound, made to listen."""
    if sock is None:
        if host == "" and socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=4096
            )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=4096)
    sock.listen(4096)  # also fine when it already listens: updates the backlog
    return sock


class Peer:
    __slots__ = (
        "sock",
        "peer",
        "parser",
        "outbuf",
        "validated",
        "missing",
        "reads",
        "paused",
        "events",
        "deadline",
        "authenticated",
        "guest",
        "challenge",
        "heard",
    )

    def __init__(self, sock: socket.socket, peer: str, authenticated: bool) -> None:
        self.sock = sock
        self.peer = peer
        self.parser = wire.RequestParser(max_len=wire.VALIDATE_LEN)
        self.outbuf = bytearray()
        self.validated = False
        # When it is dropped unless its handshake, or its work under way, progresses
        # (monotonic; None: it owes nothing, as between requests or parked in a WAIT).
        self.deadline: float | None = time.monotonic() + limits.HANDSHAKE_WAIT
        # The keys a parked WAIT still misses; None when no WAIT is parked.
        self.missing: set[bytes] | None = None
        self.reads: tuple[bytes, ...] | None = None  # a parked WAIT_GET's keys
        # Requests received are left unanswered until its unread answers drain.
        self.paused = False
        self.events = selectors.EVENT_READ  # as registered with the selector
        self.authenticated = authenticated  # proved the token (or the server takes none)
        self.guest = False  # served without the token, away from the members' keys
        # (the client's, ours) once AUTH_HELLO was answered (``admission``).
        self.challenge: tuple[bytes, bytes] | None = None
        self.heard = time.monotonic()  # when it last sent anything


def recv(peer: Peer, size: int) -> bytes:
    """What the peer sent, at most ``size`` bytes (``b""``: nothing yet); ``Drop`` when
    it closed the connection or the socket failed."""
    try:
        chunk = peer.sock.recv(size)
    except BlockingIOError:
        return b""
    except OSError as exc:
        raise Drop(str(exc)) from None
    if not chunk:
        raise Drop("closed by the client")
    return chunk


def send(peer: Peer) -> int:
    """Send what the socket takes of the peer's answers; the bytes sent."""
    if not peer.outbuf:
        return 0
    try:
        sent = peer.sock.send(peer.outbuf)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise Drop(str(exc)) from None
    del peer.outbuf[:sent]
    return sent


def wanted_events(peer: Peer) -> int:
    """The selector events the peer's connection waits for. Not reading a peer that does
    not read its answers makes TCP push back on it. A paused connection wants a round as
    soon as it can send, even with nothing left to send: its buffered requests are still
    to be answered."""
    reading = not peer.paused and len(peer.outbuf) < OUT_HIGH_WATER
    writing = peer.paused or bool(peer.outbuf)
    return (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if writing else 0)
