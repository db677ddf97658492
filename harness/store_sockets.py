"""Bare sockets to a loopback store server, for tests that play a misbehaving peer."""

from __future__ import annotations

import socket

from elastic.core.tcpstore import wire


def raw(port: int) -> socket.socket:
    """A bare connection to a loopback store server (for misbehaving-peer tests)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def handshaken(port: int) -> socket.socket:
    """A bare connection past TCPStore's ping handshake."""
    sock = raw(port)
    sock.sendall(wire.handshake(7))
    assert sock.recv(4) == wire.U32.pack(7)
    return sock
