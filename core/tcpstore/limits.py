"""What a listening server grants one peer, and how it says it refused: the TCPStore
server and the presence port (``core/rendezvous/round/presence.py``) share these rules.

Every limit is a named constant with the reason for its value. A limit that is hit is
logged once per server at warning level (later hits at debug level): a flood of bad
peers must not become a flood of log lines.
"""

from __future__ import annotations

import errno
import logging
import resource
import selectors
import socket
import time

log = logging.getLogger(__name__)

# One MULTI_GET (or GET) answer at most. Without it one 1.2 MB request naming an 8 MiB
# key 128Ki times asks for a 1 TiB answer. The largest answer the rendezvous needs is
# rank 0 reading every member's heartbeat or join record (~100 bytes to ~2 KiB each):
# 20 MiB for 10,000 nodes. 64 MiB is also ``wire.MAX_REQUEST_LEN``: what one MULTI_SET
# may write, one MULTI_GET may read back.
MAX_REPLY_LEN = 64 * 1024 * 1024
# Connections open at once, at most; more are accepted and closed at once (not left in
# the backlog, where their clients would wait for a connect timeout). The store host of
# a static job also serves every worker's store client: 1,000 nodes of 8 GPUs hold
# ~10,000 connections. The effective cap is lower when the process has fewer file
# descriptors (``connection_cap``).
MAX_CONNECTIONS = 65536
# File descriptors kept for the rest of the process when connections are capped by the
# descriptor limit: the agent also needs them for workers' pipes, log files,
# checkpoints and its own store connections.
FD_RESERVE = 256
# Seconds a new connection has to finish its handshake (torch's client and ours send it
# in their first write, so a legitimate client needs one round trip): a connection that
# never sends a valid one holds a descriptor and a buffer for nothing.
HANDSHAKE_WAIT = 10.0
# Seconds a connection with work under way (a request partly received, answers it has
# not read) may go without progress: no request completed, no byte of its answers
# taken. Idle connections between requests are never cut (agents between heartbeats,
# WAITs parked on keys for the whole job): only one that started a request and stopped
# sending, or stopped reading what it asked for. Our clients give up on a request after
# ``read_timeout`` (10 s by default) and 64 MiB crosses any link a job runs over in
# seconds, so only a peer stalling on purpose (or one whose network is gone) stays this
# long; meanwhile it holds at most one request and one answer of memory.
REQUEST_WAIT = 120.0
# Seconds the listener is not selected after ``accept`` failed for want of descriptors
# or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the listener stays readable, so retrying
# at once would spin a core. Connections closing meanwhile free descriptors; waiting
# clients stay in the kernel's backlog and are accepted after the pause.
ACCEPT_BACKOFF = 0.5

_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def connection_cap(cap: int) -> int:
    """``cap``, lowered to what the process's descriptor limit leaves after
    ``FD_RESERVE`` (at least 16: a process that low on descriptors is better refusing
    clients than failing elsewhere)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return cap
    return min(cap, max(16, soft - FD_RESERVE))


class LimitLog:
    """Logs the first hit of each limit as a warning, later ones at debug level."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.hit_once: set[str] = set()

    def hit(self, limit: str, what: str) -> None:
        if limit in self.hit_once:
            log.debug("%s: %s", self.who, what)
            return
        self.hit_once.add(limit)
        log.warning("%s: %s (%s; logged once, later ones at debug level)", self.who, what, limit)


class Listener:
    """A non-blocking listening socket registered with ``sel`` (as ``data``), accepting
    at most ``cap`` open connections and pausing on ``EMFILE`` and the like."""

    def __init__(
        self,
        sock: socket.socket,
        sel: selectors.BaseSelector,
        data: object,
        cap: int,
        limits: LimitLog,
    ) -> None:
        self.sock = sock
        self.cap = connection_cap(cap)
        self._sel, self._data, self._limits = sel, data, limits
        self.paused_until: float | None = None  # monotonic; None: selected
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, data)

    def accept(self, open_now: int) -> socket.socket | None:
        """A new connection, or None when there is none to take now. One over the cap is
        closed at once (so at most a batch of those per call, never an endless loop)."""
        for _ in range(64):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._pause(exc)
                return None  # ECONNABORTED and the like: that client gave up
            if open_now < self.cap:
                return sock
            sock.close()
            self._limits.hit("MAX_CONNECTIONS", f"{open_now} connections open; refusing more")
        return None

    def _pause(self, exc: OSError) -> None:
        self._limits.hit(
            "ACCEPT_BACKOFF",
            f"cannot accept ({exc.strerror}); not accepting for {ACCEPT_BACKOFF:g}s",
        )
        self.paused_until = time.monotonic() + ACCEPT_BACKOFF
        self._sel.unregister(self.sock)

    def resume_if_due(self, now: float) -> None:
        if self.paused_until is not None and now >= self.paused_until:
            self.paused_until = None
            self._sel.register(self.sock, selectors.EVENT_READ, self._data)


def select_timeout(now: float, *deadlines: float | None) -> float | None:
    """Seconds until the earliest of ``deadlines`` (None: none, sleep until woken)."""
    due = [d for d in deadlines if d is not None]
    return max(0.0, min(due) - now) if due else None
