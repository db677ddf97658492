"""``Channel``: one socket to a TCPStore server, with a deadline on every operation.

A request is sent and its answer read in order (the protocol has no request ids); the
caller holds the lock. After any socket failure, or a request interrupted before its
answer was read, the answer stream can no longer be trusted: the channel is dead from
then on and every later request raises the same kind of error. What a failure means is
said here once: the server closed the connection or the host refused it
(``RendezvousStoreGoneError``: nothing serves there any more), or it did not answer in
time (``RendezvousConnectionError``).

May import ``wire``; outside ``tcpstore``, ``interfaces``.
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from elastic.core.interfaces.rendezvous import RendezvousConnectionError, RendezvousStoreGoneError
from elastic.core.tcpstore import wire
from elastic.core.tcpstore.dial import dial

T = TypeVar("T")

# The host answered: nothing listens there (any more), or it dropped this connection.
_GONE_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED}

# recv() allocates its whole buffer up front: never trust a length from the wire for it.
_MAX_RECV = 4 * 1024 * 1024
# Linux ``struct tcp_info``: ``tcpi_last_ack_recv`` (ms since the peer's kernel last
# acknowledged anything) is the u32 at this offset (8 bytes of u8 fields, then rto, ato,
# snd_mss, rcv_mss, unacked, sacked, lost, retrans, fackets, last_data_sent,
# last_ack_sent, last_data_recv).
_TCPI_LAST_ACK_RECV = 56
# Keepalive probes once the connection has received nothing for this long: an unanswered
# request then still hears from the server's kernel every second while the host is up
# and reachable, and hears nothing across a partition (see ``peer_silence``; the monitor
# allows ``coordination.HOST_HEARD_WITHIN`` between answers).
_KEEPALIVE_IDLE_S = 1


class PeerClosed(Exception):
    """The server closed the connection."""


class WaitExpired(Exception):
    """A WAIT's own timeout passed (not a connection failure)."""


class Channel:
    """The socket to ``host:port``, opened by ``open_socket``; ``timeout`` bounds every
    request's round trip."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.where = f"{host}:{port}"
        self._lock = threading.Lock()
        self._rbuf = bytearray()
        self._bounds: dict[int, int] = {}  # SO_RCVTIMEO / SO_SNDTIMEO as set, in µs
        self._dead: RendezvousConnectionError | None = None
        self._closed = False

    def open_socket(self, limit: float) -> None:
        """Connect within ``limit`` seconds (a new socket: any earlier one is gone)."""
        self._closed, self._dead = False, None
        self._rbuf.clear()
        try:
            self._sock = dial(self.host, self.port, limit)
        except OSError as exc:
            raise self._connection_error(exc, "cannot connect", limit) from None
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keep_alive(self._sock)
            # Blocking, with the kernel's timeouts (``_bound``): a Python timeout makes
            # every recv a poll() and a recv, each giving up the GIL, which a thousand
            # clients in one process (the scale bench, a test) pay on every round trip.
            self._sock.settimeout(None)
            self._bounds.clear()
        except BaseException:
            self.close()
            raise

    def peer_silence(self) -> float | None:
        """Seconds since the server's host last acknowledged a packet of ours (its
        kernel: a store process that is paused or starved of CPU still has it answer
        keepalive probes; a partition or a dead host does not). None where the system
        cannot tell (no ``TCP_INFO``) or the connection is closed."""
        if self._closed or sys.platform != "linux":  # the layout below is Linux's
            return None
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        except OSError:
            return None
        if len(info) < _TCPI_LAST_ACK_RECV + 4:
            return None
        field = info[_TCPI_LAST_ACK_RECV : _TCPI_LAST_ACK_RECV + 4]
        return int.from_bytes(field, sys.byteorder) / 1000

    @property
    def broken(self) -> bool:
        """A request of this client failed or was interrupted: no request can succeed."""
        return self._dead is not None

    def close(self) -> None:
        """Idempotent; a call blocked in another thread fails at once."""
        if not self._closed:
            self._closed = True
            self._drop_socket()

    def _roundtrip(self, payload: bytes, read: Callable[[float], T] | None) -> T:
        """Send one request and read its response by ``timeout`` from now (``read`` gets
        that deadline; ``None``: the query has no response). A socket failure kills the
        client and becomes a ``RendezvousConnectionError``. Caller holds the lock."""
        if self._dead is not None:
            raise type(self._dead)(str(self._dead))
        deadline = time.monotonic() + self.timeout
        try:
            self._bound(self.timeout, socket.SO_SNDTIMEO)
            self._sock.sendall(payload)  # the timeout bounds each send of it
            return read(deadline) if read is not None else None  # type: ignore[return-value]
        except (OSError, PeerClosed) as exc:
            self._dead = self._connection_error(exc, "lost the connection")
            self._drop_socket()
            raise self._dead from None
        except WaitExpired:
            raise  # the caller cancels the WAIT, which keeps the stream in step
        except BaseException:
            # Raised between the request and the end of its answer (a signal's exception,
            # Ctrl-C): the rest of that answer would be read as the next request's. The
            # connection is out of step for good; ``Connection`` makes a new one.
            self._dead = RendezvousConnectionError(
                f"TCPStore {self.where}: a request was interrupted before its answer was read"
            )
            self._drop_socket()
            raise

    def _drop_socket(self) -> None:
        try:
            # Wakes a recv blocked in another thread, which close() alone does not.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more: closing is all there is left to do
        self._sock.close()

    def _connection_error(
        self, exc: BaseException, what: str, seconds: float | None = None
    ) -> RendezvousConnectionError:
        if self._closed:
            return RendezvousConnectionError(f"TCPStore {self.where}: the client is closed")
        if isinstance(exc, PeerClosed):
            return RendezvousStoreGoneError(
                f"TCPStore {self.where}: {what}: the server closed the connection"
            )
        if isinstance(exc, (TimeoutError, BlockingIOError)):  # BlockingIOError: SO_*TIMEO
            return RendezvousConnectionError(
                f"TCPStore {self.where}: {what}: no answer in "
                f"{self.timeout if seconds is None else seconds:.1f}s"
            )
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        gone = isinstance(exc, OSError) and exc.errno in _GONE_ERRNOS
        cls = RendezvousStoreGoneError if gone else RendezvousConnectionError
        return cls(f"TCPStore {self.where}: {what}: {reason}")

    def _read(self, n: int, deadline: float, wait: bool = False) -> bytes:
        """Exactly ``n`` bytes by ``deadline``. ``wait``: this is a WAIT's answer, whose
        deadline passing is ``WaitExpired``, not a dead connection."""
        while len(self._rbuf) < n:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError(errno.ETIMEDOUT, "timed out")
                self._bound_recv(remaining)
                chunk = self._sock.recv(min(max(65536, n - len(self._rbuf)), _MAX_RECV))
            except (TimeoutError, BlockingIOError):  # the kernel's timeout is EAGAIN
                if deadline - time.monotonic() > 0:
                    continue  # the kernel's bound was the shorter: ours has not passed
                if wait:
                    raise WaitExpired from None
                raise
            if not chunk:
                raise PeerClosed
            self._rbuf += chunk
        data = bytes(self._rbuf[:n])
        del self._rbuf[:n]
        return data

    def _bound(self, seconds: float, option: int) -> None:
        """The kernel's timeout for the next recv or send: at least a millisecond (a
        zero ``timeval`` means none). Set only when it changes (one syscall less)."""
        usec = max(1000, int(seconds * 1_000_000))
        if self._bounds.get(option) != usec:
            self._sock.setsockopt(
                socket.SOL_SOCKET, option, struct.pack("ll", *divmod(usec, 1_000_000))
            )
            self._bounds[option] = usec

    def _bound_recv(self, seconds: float) -> None:
        """The kernel's bound for the next recv, about ``seconds``: kept while it ends
        at most 1% + 2 ms after them and not before half of them, so the reads of one
        answer, and of answers with the same timeout, set it once, not each time (a
        syscall each). A bound that ends first only makes ``_read`` ask again."""
        usec = max(1000, int(seconds * 1_000_000))
        held = self._bounds.get(socket.SO_RCVTIMEO)
        if held is None or held > usec + usec // 100 + 2000 or held < usec // 2:
            self._bound(seconds, socket.SO_RCVTIMEO)

    def _u8(self, deadline: float, wait: bool = False) -> int:
        return self._read(1, deadline, wait)[0]

    def _u32(self, deadline: float) -> int:
        return int(wire.U32.unpack(self._read(4, deadline))[0])

    def _i64(self, deadline: float) -> int:
        return int(wire.I64.unpack(self._read(8, deadline))[0])

    def _blob(self, deadline: float, limit: int | None = None) -> bytes:
        (n,) = wire.U64.unpack(self._read(8, deadline))
        if limit is not None and n > limit:  # a peer that is not a store of ours
            raise RendezvousConnectionError(
                f"TCPStore {self.where}: an answer of {n} bytes where at most {limit} fit"
            )
        return self._read(int(n), deadline)


def _keep_alive(sock: socket.socket) -> None:
    """Probe an idle connection every second (where the system has the options)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", 1)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_KEEPCNT"):  # our own timeouts end a connection, not probes
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 120)
