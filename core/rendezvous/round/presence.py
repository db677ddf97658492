"""Presence: a dead agent process is seen at once, not after ``heartbeat_timeout``.

When a process dies (SIGKILL, OOM, a segfault) its kernel closes its TCP connections at
once. Each member of a formed round keeps one connection to rank 0's agent
(``PresenceClient`` -> ``PresenceServer``), so the process's death is an end of stream
on the other side: rank 0 learns that a member died, a member learns that rank 0 died,
and the monitor publishes the node as lost on its next tick (it is woken for it).

A connection that closes is not yet a death. A network blip, a proxy, or the other side
restarting its client closes it too, while the process lives on: a closed connection
counts only when no new one from the same node arrived within ``BLIP_GRACE``, and, on a
member's side, when rank 0's port refuses new connections for that long (its process is
gone, its host still answers). Saying goodbye (``bye``) before closing, as an agent does
when it leaves a round on purpose (a new round, a finished job, a departure it has
already published), is never a death. A machine that vanishes or a partition sends
nothing: those stay with the heartbeats (``heartbeat_timeout``).

What arrives on the port is untrusted: a hello is one line of at most ``HELLO_MAX``
bytes, within ``HELLO_WAIT``, naming a member of the round (signed with the job token
when there is one); anything else is closed. A stranger can at worst make us count a
node as present a little longer; it cannot close another node's connection. Connections
are capped (``MAX_CONNECTIONS``, and the descriptor limit) and ``EMFILE`` pauses
accepting, by the TCPStore server's rules (``elastic.core.tcpstore.limits``); each
limit is logged once.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable

from elastic.core.rendezvous.round import records as R
from elastic.core.tcpstore import limits

log = logging.getLogger(__name__)

BLIP_GRACE = 0.5  # s a closed connection may take to come back before it is a death
HELLO_MAX = 512  # bytes of a hello line
HELLO_WAIT = 2.0  # s a new connection has to say who it is
# Open connections at most; more are closed at once. One per member of the round (and a
# second one for a moment while one reconnects); beyond it, members rely on heartbeats.
MAX_CONNECTIONS = 4096
BYE = b"bye\n"


def hello_line(token: bytes | None, run_id: str, node_id: str) -> bytes:
    return (R.dumps(R.signed(token, run_id, {"id": node_id})) + "\n").encode()


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.node: str | None = None
        self.opened = time.monotonic()
        self.said_bye = False


class PresenceServer:
    """Rank 0's end (every agent listens; only rank 0's port is used): who of the
    round's members has no connection left, and since when."""

    def __init__(self, addr: str, token: bytes | None, run_id: str) -> None:
        self._token, self._run_id = token, run_id
        try:
            self._sock = socket.create_server((addr, 0))
        except OSError:  # an address we cannot bind (a name, or not ours): every address
            self._sock = socket.create_server(("", 0))
        self.port: int = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._members: set[str] = set()
        self._open: dict[str, int] = {}  # node -> live connections that said hello
        self._closed_at: dict[str, float] = {}  # node -> when its last one closed unasked
        self._conns: dict[socket.socket, _Conn] = {}
        # The connections yet to say hello, so the loop never scans every connection for
        # a hello that is due (rank 0 of a round of N holds N - 1 named ones).
        self._unnamed: set[_Conn] = set()
        self.on_change: Callable[[], None] = lambda: None  # a connection closed unasked
        self._stop = threading.Event()
        # The thread sleeps in select() until a socket has something, or a hello is due:
        # an idle agent's port costs no wakeups (a thousand handlers share a process in
        # the rendezvous benchmark). ``close`` wakes it through this pair.
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._limits = limits.LimitLog(f"presence port {self.port}")
        self._listener = limits.Listener(self._sock, self._sel, None, MAX_CONNECTIONS, self._limits)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="rdzv-presence", daemon=True)
        self._thread.start()

    def watch(self, members: Iterable[str]) -> None:
        """The round whose members count; deaths seen before it are forgotten."""
        with self._lock:
            self._members = set(members)
            self._closed_at.clear()

    def gone(self, grace: float = BLIP_GRACE) -> list[str]:
        """Members whose every connection closed unasked at least ``grace`` s ago."""
        now = time.monotonic()
        with self._lock:
            return sorted(
                node
                for node, at in self._closed_at.items()
                if node in self._members and not self._open.get(node) and now - at >= grace
            )

    def next_due(self, reported: Iterable[str] = (), grace: float = BLIP_GRACE) -> float | None:
        """The monotonic time the earliest unasked close not yet ``reported`` becomes a
        death, if any."""
        done = set(reported)
        with self._lock:
            times = [
                at
                for node, at in self._closed_at.items()
                if node in self._members and node not in done
            ]
        return min(times) + grace if times else None

    def close(self) -> None:
        """Stop serving; every member is told goodbye first (this is no death)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=2)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                if conn.node is not None:
                    conn.sock.sendall(BYE)
            conn.sock.close()
        self._sel.close()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            hellos = [c.opened + HELLO_WAIT for c in self._unnamed]
            timeout = limits.select_timeout(
                time.monotonic(), min(hellos, default=None), self._listener.paused_until
            )
            for key, _ in self._sel.select(timeout):
                if key.fileobj is self._sock:
                    self._accept()
                elif key.fileobj is not self._wake_r:  # the pair only says "stop"
                    self._read(self._conns[key.fileobj])  # type: ignore[index]
            now = time.monotonic()
            self._listener.resume_if_due(now)
            for conn in list(self._unnamed):
                if now - conn.opened > HELLO_WAIT:
                    self._limits.hit("HELLO_WAIT", f"no hello within {HELLO_WAIT:g}s; dropped")
                    self._drop(conn)

    def _accept(self) -> None:
        sock = self._listener.accept(len(self._conns))
        if sock is None:
            return
        sock.setblocking(False)
        conn = _Conn(sock)
        self._conns[sock] = conn
        self._unnamed.add(conn)
        self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(HELLO_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.buf += data
        if conn.node is None:
            line, sep, rest = conn.buf.partition(b"\n")
            if not sep:
                if len(conn.buf) > HELLO_MAX:
                    self._limits.hit("HELLO_MAX", f"a hello over {HELLO_MAX} bytes; dropped")
                    self._drop(conn)
                return
            node = self._node_of(line)
            if node is None:
                log.debug("presence port %d: a hello naming no member; dropped", self.port)
                self._drop(conn)
                return
            conn.node, conn.buf = node, rest
            self._unnamed.discard(conn)
            with self._lock:
                self._open[node] = self._open.get(node, 0) + 1
                self._closed_at.pop(node, None)
        if BYE.strip() in conn.buf:
            conn.said_bye = True
        conn.buf = conn.buf[-8:]  # after the hello only "bye" matters

    def _node_of(self, line: bytes) -> str | None:
        try:
            record = R.loads(line, "presence hello")
        except Exception:
            return None
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            return None
        if not R.verify(self._token, self._run_id, record):
            return None
        return record["id"]

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        self._unnamed.discard(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()
        node = conn.node
        if node is None:
            return
        with self._lock:
            self._open[node] = max(0, self._open.get(node, 0) - 1)
            unasked = not conn.said_bye and not self._open[node] and node in self._members
            if unasked:
                self._closed_at[node] = time.monotonic()
        if unasked:
            self.on_change()


class PresenceClient:
    """A member's end: one connection to rank 0's agent; ``on_gone()`` once when rank 0's
    process is gone (its connection closed unasked and did not come back)."""

    def __init__(self, addr: str, port: int, hello: bytes, on_gone: Callable[[], None]) -> None:
        self._target = (addr, port)
        self._hello = hello
        self._on_gone = on_gone
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._refused = False  # the last connect failed because nothing listened
        self._thread = threading.Thread(target=self._run, name="rdzv-presence-client", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Leave on purpose: say goodbye, so rank 0 never takes this for a death."""
        self._stop.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.sendall(BYE)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _connect(self) -> socket.socket | None:
        """A connection to rank 0's port with our hello sent; None when that failed
        (``_refused``: because rank 0's host answered that nothing listens there)."""
        self._refused = False
        try:
            sock = socket.create_connection(self._target, timeout=HELLO_WAIT)
            sock.sendall(self._hello)
            sock.settimeout(None)
            return sock
        except ConnectionRefusedError:
            self._refused = True
            return None
        except OSError:
            return None

    def _run(self) -> None:
        sock = self._connect()
        if sock is None:
            return  # rank 0 never listened (an older agent): the heartbeats still count
        while True:
            self._sock = sock
            if self._stop.is_set():  # stopped while connecting: goodbye, then close
                with contextlib.suppress(OSError):
                    sock.sendall(BYE)
                sock.close()
                return
            try:
                data = sock.recv(64)
            except OSError:
                data = b""
            if data and BYE.strip() not in data:
                continue  # rank 0 sends nothing else; ignore it
            sock.close()
            if self._stop.is_set() or data:
                return  # we stopped, or rank 0 left on purpose (and published it)
            deadline = time.monotonic() + BLIP_GRACE
            sock, refused = None, True
            while sock is None and time.monotonic() < deadline and not self._stop.is_set():
                time.sleep(0.05)
                sock = self._connect()
                refused = refused and self._refused
            if sock is None:
                # Only refusals say rank 0's process is gone. A connect that timed out
                # (a rank 0 too busy to accept, a partition) says nothing: the heartbeats
                # judge it.
                if refused and not self._stop.is_set():
                    self._on_gone()
                return
