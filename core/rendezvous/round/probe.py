"""Asking presence ports whether an agent's process is still there.

A member of a new round that never connects to rank 0 (killed after it joined, before it
learnt the round formed) leaves no connection to close: rank 0 asks its port instead
(``Liveness``, after ``presence.CONNECT_WAIT``). A refused connection is the host saying
nothing listens there, the same evidence a member takes from rank 0's port.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Iterable


def refusing(addresses: Iterable[str], timeout: float) -> set[str]:
    """Which of ``"addr:port"`` presence ports their host says nothing listens on (the
    agent's process is gone), asked all at once and waited for at most ``timeout``. A port
    that accepts, or no answer (a host down, a partition), is not a death: the heartbeats
    judge those. The connections are closed at once (a port drops one that says nothing)."""
    sel = selectors.DefaultSelector()
    refused: set[str] = set()
    try:
        for address in addresses:
            host, _, port = address.rpartition(":")
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                break  # out of descriptors: ask the rest on a later tick
            sock.setblocking(False)
            try:
                err = sock.connect_ex((host.strip("[]"), int(port)))
            except (OSError, ValueError):
                sock.close()
                continue
            if err == errno.ECONNREFUSED:
                refused.add(address)
                sock.close()
            elif err in (0, errno.EINPROGRESS):
                sel.register(sock, selectors.EVENT_WRITE, address)
            else:
                sock.close()
        deadline = time.monotonic() + timeout
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                sock = key.fileobj  # type: ignore[assignment]
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED:
                    refused.add(key.data)
                sel.unregister(sock)
                sock.close()
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()
    return refused
