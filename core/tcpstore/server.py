"""``TCPStoreServer``: a torch-free server for torch's TCPStore protocol.

One daemon thread runs a ``selectors`` loop over non-blocking sockets; ``store`` holds
the keys and queues and answers every request past the handshake. A WAIT whose keys
are missing is parked on the server (the connection is answered when the last key
appears), never polled. It behaves as torch's libuv server (torch's default) does,
except where that one is lax: a connection whose first request is not a valid VALIDATE
is dropped (libuv ignores it), and so is any malformed request.

A misbehaving client costs only its own connection: garbage drops it; a client that
sends faster than it reads stops being read (TCP pushes back on it) once its unread
responses pass ``peers.OUT_HIGH_WATER``. The limits of ``limits`` bound the rest, each logged
once: one request is capped at ``wire.MAX_REQUEST_LEN`` bytes (``wire.VALIDATE_LEN``
before the handshake), one answer at ``MAX_REPLY_LEN``, the connections at
``MAX_CONNECTIONS``; a handshake must come within ``HANDSHAKE_WAIT``, and a connection
with work under way (a request partly received, answers not taken) must make progress
within ``REQUEST_WAIT`` (one idle between requests, or parked in a WAIT, is never cut);
``EMFILE`` pauses accepting for ``ACCEPT_BACKOFF``.
With a ``token``, a connection must prove it (a challenge-response each way, ``wire``)
before any request but the protocol's own VALIDATE and PING, within a small budget of
requests, bytes and seconds and a connection cap of its own (``admission``); any other
request first, or a wrong proof, drops it: a client without the token reads and writes
nothing, and strangers flooding the port do not slow the members. The store itself is
not capped, as torch's is not.

Owns the serving thread: its lifecycle, accepting, deadlines and the handshake's
requests. May import ``peers`` (one connection and its bytes), ``store`` (the keys and
every other request), ``admission``, ``limits`` and ``wire``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TypeVar

from elastic.core.tcpstore import admission, limits, wire
from elastic.core.tcpstore.peers import (
    OUT_HIGH_WATER,
    RECV_SIZE,
    Peer,
    listening_socket,
    recv,
    send,
    wanted_events,
)
from elastic.core.tcpstore.store import Drop as _Drop
from elastic.core.tcpstore.store import Limit as _Limit
from elastic.core.tcpstore.store import ServedStore
from elastic.core.tcpstore.wire import Query

log = logging.getLogger(__name__)

R = TypeVar("R")


class TCPStoreServer:
    """Serve a TCPStore on ``host:port`` (``port=0``: any free port, see ``.port``), or on
    ``sock``, an already bound socket this server then owns (listening only on the
    address it was bound to). ``host=""`` listens on every interface, as torch does.

    ``members_only``: with a token, the key prefix that only connections that proved it
    may touch, while torch's clients are served elsewhere (``admission``).

    It serves until ``close()``: unlike torch's, dropping the last reference does not
    stop it (its thread holds one)."""

    def __init__(
        self,
        host: str = "",
        port: int = 0,
        *,
        sock: socket.socket | None = None,
        data: Mapping[bytes, bytes] | None = None,
        token: bytes | None = None,
        members_only: bytes | None = None,
    ):
        sock = listening_socket(host, port, sock)
        self._token = token  # a connection must prove it first (see the module)
        self.port: int = sock.getsockname()[1]
        # ``data``: served from the start
        self._store: ServedStore[Peer] = ServedStore(
            dict(data or {}), self._answer_woken, lambda key: self.on_delete(key)
        )
        # Called on the serving thread when a request deleted a key (what an owner in
        # the same process would otherwise poll for: a standby store handed the job's).
        self.on_delete: Callable[[bytes], object] = lambda key: None
        self._conns: dict[socket.socket, Peer] = {}
        # The connections with a deadline (usually a handful: a handshake or a request
        # under way), so the loop never scans every connection for one.
        self._timed: set[Peer] = set()
        self._sel = selectors.DefaultSelector()
        self._limits = limits.LimitLog(f"TCPStore server on port {self.port}")
        self._admission = admission.Admission[Peer](token, self._limits, members_only)
        self._listener = limits.Listener(
            sock, self._sel, "accept", limits.MAX_CONNECTIONS, self._limits
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._serving = True  # False once the loop ended, however it ended
        self._close_lock = threading.Lock()
        # Calls from other threads, run on the loop thread (``_in_loop``).
        self._calls: collections.deque[tuple[Callable[[], object], Future[object]]] = (
            collections.deque()
        )
        self._thread = threading.Thread(
            target=self._run, name=f"tcpstore-server-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def clients(self) -> int:
        """Connections open now."""
        return len(self._conns)

    def clients_heard_within(self, seconds: float) -> int:
        """Connections that sent something in the last ``seconds``, or wait parked in a
        WAIT for a key: those whose other end is likely still there."""
        since = time.monotonic() - seconds
        peers = list(self._conns.values())  # one step under the GIL: the loop may add more
        return sum(1 for p in peers if p.heard >= since or p.missing is not None)

    def clear(self, keep_prefix: bytes = b"") -> int:
        """Delete every key that does not start with ``keep_prefix``; how many went.

        Run on the serving thread, so it is atomic with respect to every request. Waiters
        are left parked: a deleted key was present, so nobody waits for it."""

        return self._in_loop(lambda: self._store.clear(keep_prefix))

    def _in_loop(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` on the loop thread and return its result: the store is that
        thread's alone, so no request ever sees it half changed."""
        done: Future[object] = Future()
        with self._close_lock:
            if self._stopping or not self._serving:
                raise RuntimeError(f"the TCPStore server on port {self.port} is closed")
            self._calls.append((fn, done))
            self._wake_w.send(b"c")
        return done.result()  # type: ignore[return-value]

    def _run_calls(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)
        while self._calls:
            fn, done = self._calls.popleft()
            try:
                done.set_result(fn())
            except Exception as exc:
                done.set_exception(exc)

    def close(self) -> None:
        """Stop serving and close every connection; idempotent."""
        with self._close_lock:
            if self._stopping:
                return
            self._stopping = True
            self._wake_w.send(b"x")
        self._thread.join()
        # Closed here, not by the loop: the loop may see _stopping and end before the
        # byte above is sent, which must not then meet a closed socket.
        self._wake_r.close()
        self._wake_w.close()

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is set now (a read of one dict entry: safe from any thread)."""
        return key in self._store.data

    def close_and_take(self) -> dict[bytes, bytes]:
        """Stop serving (as ``close``) and return every key and value as they were last:
        nothing can change them once the loop has stopped (a store handed over)."""
        self.close()
        return dict(self._store.data)

    def __enter__(self) -> TCPStoreServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                next_deadline = min(
                    (c.deadline for c in self._timed if c.deadline is not None), default=None
                )
                timeout = limits.select_timeout(
                    time.monotonic(), next_deadline, self._listener.paused_until
                )
                for key, mask in self._sel.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":  # a call, or close() set _stopping
                        self._run_calls()
                    else:
                        self._service(key.data, mask)
                now = time.monotonic()
                self._listener.resume_if_due(now)
                if next_deadline is not None and now >= next_deadline:
                    self._expire(now)
        except Exception:
            # A bug, not a client: say so, and let the clients see the store gone.
            log.exception("TCPStore server on port %d failed", self.port)
        finally:
            with self._close_lock:  # no call is queued after this
                self._serving = False
            for _, done in self._calls:
                done.set_exception(RuntimeError(f"the TCPStore server on port {self.port} closed"))
            self._calls.clear()
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._sel.close()
            self._listener.sock.close()

    def _accept(self) -> None:
        # Level-triggered: whatever is left in the backlog is accepted next round.
        for _ in range(64):
            sock = self._listener.accept(self._admission.cap_count(len(self._conns)))
            if sock is None:
                return
            try:
                addr = sock.getpeername()
            except OSError:  # reset before we looked
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Peer(sock, f"{addr[0]}:{addr[1]}", self._token is None)
            self._conns[sock] = conn
            self._timed.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            evicted = self._admission.arrived(conn)
            if evicted is not None:
                self._drop(evicted)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._timed if c.deadline is not None and c.deadline <= now]:
            if conn.validated and conn.authenticated:
                what = (
                    f"no progress for {limits.REQUEST_WAIT:g}s from {conn.peer} (a request "
                    "partly sent, or answers not read)"
                )
                self._limits.hit("REQUEST_WAIT", f"{what}; dropped")
            else:
                what = f"no handshake from {conn.peer} within {limits.HANDSHAKE_WAIT:g}s"
                self._limits.hit("HANDSHAKE_WAIT", f"{what}; dropped")
            self._drop(conn)

    def _retime(self, conn: Peer, progressed: bool) -> None:
        """A validated connection with work under way (the rest of a request it began,
        answers it has not taken) owes progress (a request answered, bytes sent) within
        ``REQUEST_WAIT``; one between requests owes nothing, however long."""
        if not (conn.validated and conn.authenticated):
            return  # the handshake deadline stands
        if not (conn.parser.partial or conn.outbuf):
            conn.deadline = None
            self._timed.discard(conn)
        elif progressed or conn.deadline is None:
            conn.deadline = time.monotonic() + limits.REQUEST_WAIT
            self._timed.add(conn)

    def _service(self, conn: Peer, mask: int) -> None:
        try:
            sent = send(conn) if mask & selectors.EVENT_WRITE else 0
            if mask & selectors.EVENT_READ:
                self._recv(conn)
            answered = self._process(conn)
            sent += send(conn)
            self._update_events(conn)
            self._retime(conn, answered > 0 or sent > 0)
        except _Limit as why:
            self._limits.hit(why.limit, f"{why} from {conn.peer}; dropped")
            self._drop(conn)
        except admission.Refused as why:
            if why.limit is not None:
                self._limits.hit(why.limit, f"{why} from {conn.peer}; dropped")
            else:
                log.debug("TCPStore server: dropping %s: %s", conn.peer, why)
            self._drop(conn)
        except _Drop as why:
            log.debug("TCPStore server: dropping %s: %s", conn.peer, why)
            self._drop(conn)
        except Exception:
            # A bug that a request triggered: it costs that client only.
            log.exception("TCPStore server: dropping %s", conn.peer)
            self._drop(conn)

    def _recv(self, conn: Peer) -> None:
        chunk = recv(conn, self._admission.recv_size(conn, RECV_SIZE))
        if not chunk:
            return
        conn.heard = time.monotonic()
        self._admission.charge(conn, received=len(chunk))
        conn.parser.feed(chunk)

    def _process(self, conn: Peer) -> int:
        """Answer the whole requests received, but pause at the high-water mark of unread
        answers: the rest is answered as those drain, one batch per loop round. How many
        were answered."""
        answered = 0
        try:
            while len(conn.outbuf) < OUT_HIGH_WATER:
                req = conn.parser.next()
                if req is None:
                    conn.paused = False
                    return answered
                self._handle(conn, req)
                answered += 1
        except wire.RequestTooLarge as exc:
            raise _Limit("MAX_REQUEST_LEN", str(exc)) from None
        except wire.ProtocolError as exc:
            raise _Drop(str(exc)) from None
        conn.paused = conn.parser.buffered > 0
        return answered

    def _answer_woken(self, conn: Peer) -> None:
        """A parked connection was answered by another one's request: send the answer now
        (an idle socket takes it whole), leaving the loop only what it did not take. A
        send that fails is left to the loop as well, which drops that connection, never
        the one whose request woke it. A thousand waiters woken by one outcome cost a
        send each, not two selector changes and a pass of the loop each."""
        with contextlib.suppress(_Drop):
            send(conn)
        self._update_events(conn)

    def _update_events(self, conn: Peer) -> None:
        events = wanted_events(conn)
        if events != conn.events:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    def _drop(self, conn: Peer) -> None:
        self._store.unpark(conn)
        self._admission.left(conn)
        self._timed.discard(conn)
        del self._conns[conn.sock]
        self._sel.unregister(conn.sock)
        conn.sock.close()

    # --- requests ------------------------------------------------------------------------

    def _handle(self, conn: Peer, req: wire.Request) -> None:
        """The handshake's requests here; every other one is the store's (``store``)."""
        query = req.query
        self._admission.charge(conn, requests=1)
        if not conn.validated:
            if query is not Query.VALIDATE or req.number != wire.VALIDATION_MAGIC:
                raise _Drop("the first request is not a valid VALIDATE")
            conn.validated = True
            if conn.authenticated:
                admission.admit(conn)
            else:  # the handshake deadline stands until the token is proved
                conn.parser.max_len = self._admission.request_limit()
        elif query is Query.PING:
            conn.outbuf += wire.U32.pack(req.number)
        elif query in (Query.AUTH_HELLO, Query.AUTH_PROOF) or not self._admission.admits(conn, req):
            conn.outbuf += self._admission.handshake(conn, req)
        else:
            self._store.answer(conn, req)
