"""Opening a TCP connection, for every client of ours (store clients, presence).

``socket.create_connection`` resolves the host with ``getaddrinfo``, which runs a host
given as ``str`` through Python's own IDNA codec first: tens of microseconds of pure
Python per connection, and a round makes a thousand of them at once (every member's
presence connection to rank 0). An ASCII host (every IP address, every hostname a job
uses) is the same name as bytes, which ``getaddrinfo`` takes as it is.
"""

from __future__ import annotations

import socket


def dial(host: str, port: int, timeout: float | None) -> socket.socket:
    """A connected socket to ``host:port`` within ``timeout`` seconds; raises ``OSError``."""
    name: str | bytes = host.encode("ascii") if host.isascii() else host
    return socket.create_connection((name, port), timeout=timeout)  # type: ignore[arg-type]
