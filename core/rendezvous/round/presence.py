"""Presence: a dead agent process is seen at once, not after ``heartbeat_timeout``.

When a process dies (SIGKILL, OOM, a segfault) its kernel closes its TCP connections at
once. Each member of a formed round keeps a connection to rank 0's agent, and to rank 1's
(the deputy) once rank 0 is gone (``presence_client.PresenceClient`` ->
``PresenceServer``), so a death is an end of stream on the other side, published as lost
on a tick woken for it.

A connection that closes is not yet a death (a blip, a proxy, a client restarting): it
counts only when no new one from the same node arrived within ``BLIP_GRACE``, and, on a
member's side, when the serving rank's port refuses new connections for that long (its
process is gone, its host still answers). Saying goodbye (``bye``) before closing, as an agent does
when it leaves a round on purpose (a new round, a finished job), is never a death; nor is
``left``, a departure the member has just published (SIGTERM, scale-in), which also makes
the serving rank read the round's facts at once. A serving rank that finds the round's
facts changed (a member lost, a node waiting to join, the job closed) says ``news`` on
every connection, and each member reads them at once instead of on its next tick: a
departure reaches every survivor in two store round trips, not up to a heartbeat
interval. A vanished machine or a partition stays with the heartbeats, and presence
makes those sooner too: after each keep-alive the store acknowledged, a member says
``beat <value>`` to rank 0, and rank 0 to every member (rank 0 watches every member's
heartbeat, each member watches rank 0's); the watcher dates that value from then rather
than from its next read of the store, up to a heartbeat interval later
(``liveness.LivenessTracker``: a verdict comes ``heartbeat_timeout`` after a value was
first known, and the word is sent after the store applied it, so the lease's argument
holds unchanged). The word is taken only for the value the watcher then reads, and a
value carries 64 random bits (``lease.Lease.renew``): a word from anyone else (a member
does not prove who listens on rank 0's port) names a value that was in the store
already, or none.

What arrives on the port is untrusted. Rank 0 opens each connection with a fresh random
challenge (``NONCE_LEN`` hex digits and a newline); the member answers with one hello line
of at most ``HELLO_MAX`` bytes, within ``HELLO_WAIT``, naming itself and the round and
carrying that challenge, signed with the job token when there is one (``hello_line``). A
hello for another connection, round or node proves nothing (a replay is refused): only
a connection that proved itself counts, and only its close can make a member lost.
Anything else (late, too long, not JSON, a non-ASCII signature) closes that connection
alone, with one logged line. Without a token anyone may send a hello: a job on a shared
network sets one. Connections are capped (``MAX_CONNECTIONS``, the descriptor limit) and
``EMFILE`` pauses accepting, by ``elastic.core.tcpstore.limits``; each limit logged once.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.signing import mac
from elastic.core.tcpstore import limits

BLIP_GRACE = 0.5  # s a closed connection may take to come back before it is a death
# s a member of a new round has to connect before rank 0 asks its port whether its
# process is still there (it connects the instant it learns the round formed).
CONNECT_WAIT = 1.0
HELLO_MAX = 512  # bytes of a hello line
HELLO_WAIT = 2.0  # s a new connection has to say who it is
NONCE_LEN = 32  # hex digits of rank 0's challenge (128 random bits)
# Open connections at most; more are closed at once. One per member of the round (and a
# second one for a moment while one reconnects); beyond it, members rely on heartbeats.
MAX_CONNECTIONS = 4096
BYE = b"bye\n"
LEFT = b"left\n"  # a member's goodbye for a departure it published: look now
NEWS = b"news\n"  # a serving rank's word that the round's facts changed: look now
# A member's word, after a keep-alive was acknowledged, naming the value it wrote:
# ``beat <value>``. Rank 0 dates the value from its receipt (``beat_hints``).
BEAT = b"beat "
LINE_MAX = 64  # bytes of a line after the hello; a longer one is dropped unread


def beat_line(value: bytes) -> bytes | None:
    """The ``beat`` line naming heartbeat ``value``; None when it cannot be one line."""
    line = BEAT + value + b"\n"
    return None if len(line) > LINE_MAX or b"\n" in value else line


def beat_value(line: bytes) -> bytes | None:
    """The heartbeat value a received line (its newline taken off) names, if a ``beat``."""
    return line[len(BEAT) :] if line.startswith(BEAT) and len(line) < LINE_MAX else None


_HELLO_KEY = "presence/hello"  # what a hello's signature is bound to, besides the job


def _body(node_id: str, rnd: int, nonce: str) -> dict[str, Any]:
    return {"id": node_id, "nonce": nonce, "round": rnd}


def _sig(token: bytes, run_id: str, body: dict[str, Any]) -> str:
    return mac(token, run_id, _HELLO_KEY, R.dumps(body).encode())


def hello_line(token: bytes | None, run_id: str, node_id: str, rnd: int, nonce: str) -> bytes:
    """What ``node_id``, a member of round ``rnd``, answers rank 0's challenge ``nonce``
    with: bound to all three, and signed with the job token when there is one."""
    record = _body(node_id, rnd, nonce)
    if token is not None:
        record["sig"] = _sig(token, run_id, record)
    return (R.dumps(record) + "\n").encode()


def read_hello(
    token: bytes | None, run_id: str, line: bytes, nonce: str, oldest: int
) -> tuple[str, int] | str:
    """(the node a hello line proves, its round) when it answers challenge ``nonce`` for
    round ``oldest`` or a later one (rank 0 may not have taken the round yet when a
    member connects), signed with ``token`` if there is one; else why not. Total: any
    bytes give one or the other."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "not JSON"
    if not isinstance(record, dict):
        return "not a JSON object"
    node, rnd = record.get("id"), record.get("round")
    if not isinstance(node, str) or not isinstance(rnd, int) or isinstance(rnd, bool):
        return "no node id or round"
    if record.get("nonce") != nonce:
        return "not an answer to this connection's challenge (a replay?)"
    if rnd < oldest:
        return f"for round {rnd}, an older one than {oldest}"
    if token is None:
        return node, rnd
    sig = record.get("sig")
    expected = _sig(token, run_id, _body(node, rnd, nonce)).encode()
    # Compared as bytes: a str with non-ASCII characters makes compare_digest raise.
    if not (
        isinstance(sig, str) and hmac.compare_digest(sig.encode("utf-8", "surrogatepass"), expected)
    ):
        return "not signed with the job token"
    return node, rnd


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.node: str | None = None  # once its hello proved it
        self.round = -1  # the round its hello named
        self.nonce = secrets.token_hex(NONCE_LEN // 2)
        self.opened = time.monotonic()
        self.said_bye = False


class PresenceServer:
    """A serving rank's end (every agent listens; only ranks 0 and 1 are connected to):
    who of the round's members has no connection left, and since when."""

    def __init__(self, addr: str, token: bytes | None, run_id: str) -> None:
        self._token, self._run_id = token, run_id
        # Every member connects the instant its round forms: a backlog of Python's
        # default (128) would drop most of a large round's connects, each then retried a
        # second later by its kernel.
        try:
            self._sock = socket.create_server((addr, 0), backlog=MAX_CONNECTIONS)
        except OSError:  # an address we cannot bind (a name, or not ours): every address
            self._sock = socket.create_server(("", 0), backlog=MAX_CONNECTIONS)
        self.port: int = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._members: set[str] = set()
        self._round = -1  # the round whose members count (``watch``)
        self._open: dict[str, int] = {}  # node -> live connections that proved it
        self._newest: dict[str, int] = {}  # node -> the newest round a hello of it named
        self._watched_at = time.monotonic()  # when ``watch`` named the round
        self._closed_at: dict[str, float] = {}  # node -> when its last one closed unasked
        self._beats: dict[str, tuple[bytes, float]] = {}  # node -> (its ``beat``, when)
        self._conns: dict[socket.socket, _Conn] = {}
        # The connections yet to say hello, in the order accepted, so the first is the
        # first due: the loop looks at no other for a hello that is due (rank 0 of a round
        # of N holds N - 1 named ones, and takes N - 1 hellos at once).
        self._unnamed: dict[_Conn, None] = {}
        self.on_change: Callable[[], None] = lambda: None  # a connection closed unasked
        self.on_left: Callable[[], None] = lambda: None  # a member said it left the job
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

    def watch(self, members: Iterable[str], rnd: int) -> None:
        """Round ``rnd``, whose members count; deaths seen before it are forgotten."""
        with self._lock:
            self._members = set(members)
            self._round = rnd
            self._closed_at.clear()
            self._newest = {n: r for n, r in self._newest.items() if n in self._members}
            self._beats = {n: b for n, b in self._beats.items() if n in self._members}
            self._watched_at = time.monotonic()

    def silent(self) -> tuple[list[str], float]:
        """Members that have not said hello for the watched round (nor closed a connection
        that did), and when the round was watched (monotonic)."""
        with self._lock:
            quiet = [
                n
                for n in self._members
                if self._newest.get(n, -1) < self._round and n not in self._closed_at
            ]
            return sorted(quiet), self._watched_at

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

    def beat_hints(self) -> dict[str, tuple[bytes, float]]:
        """The last heartbeat value each watched member said it wrote and had
        acknowledged (``beat``), and when that word arrived (monotonic): the value was in
        the store by then."""
        with self._lock:
            return {n: b for n, b in self._beats.items() if n in self._members}

    def tell_beat(self, value: bytes) -> None:
        """Say ``beat <value>`` on every proved connection: our keep-alive writing
        ``value`` was acknowledged. Never blocks, as ``tell_news``."""
        line = beat_line(value)
        if line is None:
            return
        for conn in list(self._conns.values()):
            if conn.node is not None:
                with contextlib.suppress(OSError):
                    conn.sock.send(line)

    def tell_news(self) -> None:
        """Say ``news`` on every proved connection: its member reads the round's facts
        now. Never blocks: a member whose socket buffer is full is told nothing (it reads
        them on its next tick anyway)."""
        for conn in list(self._conns.values()):
            if conn.node is not None:
                with contextlib.suppress(OSError):
                    conn.sock.send(NEWS)

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
            first = next(iter(self._unnamed), None)
            timeout = limits.select_timeout(
                time.monotonic(),
                None if first is None else first.opened + HELLO_WAIT,
                self._listener.paused_until,
            )
            for key, _ in self._sel.select(timeout):
                if key.fileobj is self._sock:
                    self._accept()
                elif key.fileobj is not self._wake_r:  # the pair only says "stop"
                    conn = self._conns.get(key.fileobj)  # type: ignore[call-overload]
                    if conn is not None:
                        self._serve(conn)
            now = time.monotonic()
            self._listener.resume_if_due(now)
            while self._unnamed:
                conn = next(iter(self._unnamed))
                if now - conn.opened <= HELLO_WAIT:
                    break
                self._limits.hit("HELLO_WAIT", f"no hello within {HELLO_WAIT:g}s; dropped")
                self._drop(conn)

    def _serve(self, conn: _Conn) -> None:
        """Read from one connection; whatever goes wrong costs that connection only."""
        try:
            self._read(conn)
        except Exception as exc:  # a bug a peer's bytes found: never the whole port
            self._limits.hit("PEER_ERROR", f"dropped a connection on {exc!r}")
            self._drop(conn)

    def _accept(self) -> None:
        # A round's members connect at once: a batch a wakeup, as many as are queued (a
        # bounded batch: the hellos already accepted are read in between).
        for _ in range(64):
            sock = self._listener.accept(len(self._conns))
            if sock is None:
                return
            sock.setblocking(False)
            conn = _Conn(sock)
            try:  # a line of 33 bytes into an empty socket buffer: never a partial send
                sock.send(conn.nonce.encode() + b"\n")
            except OSError:
                sock.close()
                continue
            self._conns[sock] = conn
            self._unnamed[conn] = None
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
            with self._lock:
                oldest = self._round
            proved = read_hello(self._token, self._run_id, line, conn.nonce, oldest)
            if isinstance(proved, str):
                # The first refused hello is a warning, later ones are at debug level.
                self._limits.hit("HELLO", f"a hello that proves nothing ({proved}); dropped")
                self._drop(conn)
                return
            (node, conn.round), conn.buf = proved, rest
            conn.node = node
            self._unnamed.pop(conn, None)
            with self._lock:
                self._open[node] = self._open.get(node, 0) + 1
                self._newest[node] = max(conn.round, self._newest.get(node, -1))
                self._closed_at.pop(node, None)
        *lines, conn.buf = conn.buf.split(b"\n")
        if len(conn.buf) > LINE_MAX:
            conn.buf = b""  # no word is that long: skip to the next line
        left = False
        for line in lines:
            if LEFT.strip() in line or BYE.strip() in line:
                left = left or (LEFT.strip() in line and not conn.said_bye)
                conn.said_bye = True
            elif (value := beat_value(line)) is not None and conn.node is not None:
                with self._lock:
                    self._beats[conn.node] = (value, time.monotonic())
        if left:
            self.on_left()

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        self._unnamed.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()
        node = conn.node
        if node is None:
            return  # it never proved itself: its close says nothing about anyone
        with self._lock:
            self._open[node] = max(0, self._open.get(node, 0) - 1)
            unasked = (
                not conn.said_bye
                and not self._open[node]
                and node in self._members
                and conn.round == self._round
            )
            if unasked:
                self._closed_at[node] = time.monotonic()
        if unasked:
            self.on_change()
