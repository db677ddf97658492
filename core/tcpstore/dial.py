"""Opening a TCP connection, for the store's clients and probes, and the name
``getaddrinfo`` is given for a host (``lookup_name``, for every lookup of ours, the
presence connections' too: those connect without blocking, on one thread).

``getaddrinfo`` runs a host given as ``str`` through Python's own IDNA codec first: tens
of microseconds of pure Python per connection, and a round makes a thousand of them at
once (every member's presence connection to rank 0); the first one also imports the codec
(``encodings.idna``, with ``stringprep`` and ``unicodedata``: about 3 ms of every agent's
start). An ASCII host (every IP address, every hostname a job uses) is the same name as
bytes, which ``getaddrinfo`` takes as it is.
"""

from __future__ import annotations

import socket


def lookup_name(host: str) -> str | bytes:
    """``host`` as ``getaddrinfo`` takes it without the IDNA codec: bytes when ASCII."""
    return host.encode("ascii") if host.isascii() else host


def dial(host: str, port: int, timeout: float | None) -> socket.socket:
    """A connected socket to ``host:port`` within ``timeout`` seconds; raises ``OSError``."""
    address = (lookup_name(host), port)
    return socket.create_connection(address, timeout=timeout)  # type: ignore[arg-type]
