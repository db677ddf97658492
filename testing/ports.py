"""Ports: a free one for a server a test or bench starts, and which process listens on one.

``free_port`` binds port 0 and closes the socket, so the port is free *now*: a server
started right after gets it unless something else takes it first, which is rare enough on
one machine for tests and benches.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now on ``host`` (loopback unless told)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listening_pid(port: int, pids: Iterable[int]) -> int | None:
    """Which of ``pids`` holds the TCP socket listening on ``port`` (any address), found
    through the socket's inode in ``/proc/net/tcp{,6}`` and the processes' fds."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    return pid
            except OSError:
                continue
    return None
