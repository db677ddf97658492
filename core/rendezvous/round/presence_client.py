"""A member's end of presence (``presence.py``): one connection to a serving rank's
agent, answering its challenge with our hello; it tells the member when that rank's
process is gone (its connection closed unasked and its port refuses us), when it left on
purpose (``bye``), when it says the round's facts changed (``news``), and which
heartbeat value it last had acknowledged (``beat``).

Every connection of the process is driven by one thread (``_Loop``, a selector), started
with the first: a connection costs a socket, not a thread. An agent has one or two; a
process holding a thousand handlers (the rendezvous bench) used to start a thousand
threads the instant a round formed, while the round's last members were still returning.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from elastic.core.rendezvous.round.presence import (
    BLIP_GRACE,
    BYE,
    HELLO_WAIT,
    LEFT,
    LINE_MAX,
    NEWS,
    NONCE_LEN,
    beat_line,
    beat_value,
)
from elastic.core.tcpstore.dial import lookup_name

log = logging.getLogger(__name__)

RETRY_PAUSE = 0.05  # s between connects while a closed connection may come back
_HEX = frozenset(b"0123456789abcdef")
_NONBLOCK = getattr(socket, "SOCK_NONBLOCK", 0)  # Linux's; elsewhere setblocking does it

# A connection's states, in the order a good one goes through them.
# A non-blocking connect under way, then the serving rank's challenge: one state, read
# from the start (a failed connect makes the socket readable too, and a recv says why),
# so a connection costs no turn of the loop, nor a selector change, to learn it connected.
_CONNECTING = "connecting"
_OPEN = "open"  # our hello sent: reading its words
_PAUSE = "pause"  # closed unasked: the next connect after a pause, within BLIP_GRACE
_ENDED = "ended"


class PresenceClient:
    """A member's end: one connection to a serving rank's agent; ``on_gone()`` once when
    its process is gone (its connection closed unasked and did not come back),
    ``on_bye()`` once when it said goodbye (it left on purpose), ``on_news()`` each time it
    says the round's facts changed. The calls come on the process's presence thread:
    they must not block."""

    def __init__(
        self,
        addr: str,
        port: int,
        hello: Callable[[str], bytes],
        on_gone: Callable[[], None],
        on_bye: Callable[[], None] = lambda: None,
        on_news: Callable[[], None] = lambda: None,
    ) -> None:
        self._target = (addr, port)
        self._hello = hello  # our hello for rank 0's challenge
        self._on_gone, self._on_bye, self._on_news = on_gone, on_bye, on_news
        self._stop = threading.Event()
        self.ended = threading.Event()  # the connection is closed for good
        self._sock: socket.socket | None = None  # kept once our hello is sent
        self._goodbye = BYE
        # The serving rank's last ``beat``: (the value, when it arrived; monotonic).
        self.beat: tuple[bytes, float] | None = None
        # The presence thread's own (nothing else touches them).
        self._state = _CONNECTING
        self._attempt: socket.socket | None = None  # the socket of the current state
        self._addresses: list[tuple] = []  # the current connect's addresses left to try
        self._refused = False  # the last connect failed because nothing listened
        self._grace_end: float | None = None  # coming back: BLIP_GRACE ends then
        self._grace_refused = True  # every connect while coming back was refused
        self._buf = b""
        self._timer = 0  # generation of the state's deadline (older ones are void)
        _loop().poke(self)

    def stop(self, leaving: bool = False) -> None:
        """Leave on purpose: say goodbye, so rank 0 never takes this for a death;
        ``leaving``: this node left the job and published it (``LEFT``)."""
        self._goodbye = LEFT if leaving else BYE
        self._stop.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.send(self._goodbye, socket.MSG_DONTWAIT)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        _loop().poke(self)

    def say_beat(self, value: bytes) -> None:
        """Tell the serving rank that our keep-alive writing ``value`` was acknowledged
        (``presence.BEAT``). Never blocks: a word that does not fit the socket's buffer at
        once is not sent (the store's value says the same a read later)."""
        line = beat_line(value)
        sock = self._sock
        if sock is None or self._stop.is_set() or line is None:
            return
        with contextlib.suppress(OSError):
            sock.send(line, socket.MSG_DONTWAIT)

    # The presence thread's side: a state machine driven by ``_Loop``.

    def _begin(self, loop: _Loop) -> None:
        """A new connect: every address of the serving rank's host, in turn. (A host
        given by name is looked up here, on the presence thread: an agent has one or
        two connections, and the rendezvous bench's thousand name an address.)"""
        self._refused = False
        try:
            host = lookup_name(self._target[0])
            self._addresses = socket.getaddrinfo(host, self._target[1], 0, socket.SOCK_STREAM)
        except OSError:
            self._addresses = []
        self._next_address(loop)

    def _next_address(self, loop: _Loop) -> None:
        while self._addresses:
            family, kind, proto, _, address = self._addresses.pop(0)
            try:  # non-blocking from the start where the system can: no ioctl for it
                sock = socket.socket(family, kind | _NONBLOCK, proto)
            except OSError:
                continue
            if not _NONBLOCK:
                sock.setblocking(False)
            code = sock.connect_ex(address)
            if code in (0, errno.EINPROGRESS):
                self._state, self._attempt, self._buf = _CONNECTING, sock, b""
                # The connect's wait and the challenge's, each HELLO_WAIT, in one.
                loop.watch(self, sock, selectors.EVENT_READ, 2 * HELLO_WAIT)
                return
            sock.close()
            self._refused = code == errno.ECONNREFUSED
        self._failed(loop)

    def _failed(self, loop: _Loop) -> None:
        """This connect failed (``_refused``: nothing listened there)."""
        self._drop_attempt(loop)
        if self._grace_end is None:
            # The serving rank named this port when it joined the round, so it listened
            # then: a refusal from the first connect on is its process gone (it died
            # after joining, before we connected), judged as a closed connection is.
            self._grace_end = time.monotonic() + BLIP_GRACE
            self._grace_refused = self._refused
        else:
            self._grace_refused = self._grace_refused and self._refused
        if self._stop.is_set():
            return self._end(loop)
        if time.monotonic() < self._grace_end:
            self._state = _PAUSE
            loop.after(self, RETRY_PAUSE)
            return None
        if self._grace_refused:
            # Only refusals say the serving rank's process is gone. A connect that timed
            # out (a rank too busy to accept, a partition) says nothing: the heartbeats
            # judge it.
            _call(self._on_gone)
        return self._end(loop)

    def _ready(self, loop: _Loop) -> None:
        """The socket of the current state can be read (connecting: it connected and the
        challenge came, or the connect failed)."""
        sock = self._attempt
        assert sock is not None
        connecting = self._state == _CONNECTING
        size = NONCE_LEN + 1 - len(self._buf) if connecting else 4 * LINE_MAX
        try:
            data = sock.recv(size)
        except BlockingIOError:
            return None
        except OSError as exc:
            if connecting:  # the connect failed (or the connection, before a challenge)
                self._refused = exc.errno == errno.ECONNREFUSED
                self._drop_attempt(loop)
                return self._next_address(loop)
            data = b""
        if connecting:
            return self._challenged(loop, sock, data)
        return self._heard(loop, sock, data)

    def _challenged(self, loop: _Loop, sock: socket.socket, data: bytes) -> None:
        """Part of the serving rank's challenge arrived; answered once whole."""
        self._buf += data
        if data and not self._buf.endswith(b"\n") and len(self._buf) <= NONCE_LEN:
            return None
        nonce = self._buf.strip()
        if not data or len(nonce) != NONCE_LEN or not set(nonce) <= _HEX:
            self._refused = False  # not our presence port, or it closed: no refusal
            return self._failed(loop)
        hello = self._hello(nonce.decode())
        try:
            whole = sock.send(hello) == len(hello)  # a few hundred bytes: an empty buffer
        except OSError:
            whole = False
        if not whole:
            return self._failed(loop)
        self._state, self._buf, self._grace_end = _OPEN, b"", None
        self._sock = sock
        if self._stop.is_set():  # stopped while connecting: goodbye, then close
            with contextlib.suppress(OSError):
                sock.send(self._goodbye, socket.MSG_DONTWAIT)
            return self._end(loop)
        loop.watch(self, sock, selectors.EVENT_READ, None)
        return None

    def _heard(self, loop: _Loop, sock: socket.socket, data: bytes) -> None:
        """The serving rank's words, or the end of its connection."""
        *lines, buf = (self._buf + data).split(b"\n")
        self._buf = buf[-LINE_MAX:]  # no word is longer: the rest of a longer line is junk
        if data and not any(BYE.strip() in line for line in lines):
            if any(NEWS.strip() in line for line in lines):
                _call(self._on_news)
            beats = [v for v in map(beat_value, lines) if v is not None]
            if beats:
                self.beat = (beats[-1], time.monotonic())
            return None
        self._sock = None
        if self._stop.is_set() or data:  # we stopped, or it left on purpose
            if not self._stop.is_set():
                _call(self._on_bye)
            return self._end(loop)
        # Closed unasked: a death only if it does not come back within BLIP_GRACE.
        self._refused = True
        return self._failed(loop)

    def _expired(self, loop: _Loop) -> None:
        """The current state's deadline passed."""
        if self._state == _PAUSE:
            if self._stop.is_set():
                return self._end(loop)
            return self._begin(loop)
        if self._state == _CONNECTING:  # timed out: says nothing
            self._refused = False
            return self._failed(loop)
        return None

    def _stopped(self, loop: _Loop) -> None:
        """``stop`` was called: a connection not yet ours is dropped (it said no hello,
        so it proves nothing); ours is closed by the serving rank's answer to its goodbye
        or by the shutdown ``stop`` made."""
        if self._state != _OPEN:
            self._end(loop)

    def _drop_attempt(self, loop: _Loop) -> None:
        """Close the current state's socket, out of the selector first."""
        if self._attempt is not None:
            loop.forget(self._attempt)
            self._attempt.close()
            self._attempt = None

    def _end(self, loop: _Loop) -> None:
        self._drop_attempt(loop)
        self._sock = None
        self._state = _ENDED
        self._timer += 1
        loop.drop(self)
        self.ended.set()


def _call(callback: Callable[[], None]) -> None:
    """A member's callback, on the presence thread: its failure is logged, the thread
    serves the other connections on."""
    try:
        callback()
    except Exception:
        log.exception("a presence callback failed")


class _Loop:
    """The one thread serving every ``PresenceClient`` of the process: a selector over
    their sockets, with a deadline per connection, woken through a socket pair when a
    client is added or stopped."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_in, self._wake_out = socket.socketpair()
        for end in (self._wake_in, self._wake_out):
            end.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._incoming: list[PresenceClient] = []  # added or stopped since the last turn
        self._clients: set[PresenceClient] = set()
        self._timers: list[tuple[float, int, int, PresenceClient]] = []
        self._order = itertools.count()  # ties in the timer heap
        self._thread = threading.Thread(target=self._run, name="rdzv-presence-clients", daemon=True)
        self._thread.start()

    def poke(self, client: PresenceClient) -> None:
        """Look at ``client`` on the next turn (new, or stopped)."""
        with self._lock:
            pending = bool(self._incoming)
            self._incoming.append(client)
        if pending:
            return  # the wake that brought the others is unread yet: it takes this one too
        with contextlib.suppress(OSError):  # full: a wake is pending anyway
            self._wake_out.send(b"\0")

    # Called on the loop's thread, by the clients.

    def watch(
        self, client: PresenceClient, sock: socket.socket, events: int, wait: float | None
    ) -> None:
        """Wake ``client`` for ``events`` on ``sock`` (its attempt), or when ``wait``
        seconds passed without them (None: no deadline)."""
        fd = sock.fileno()
        key = self._selector.get_map().get(fd)
        if key is not None and key.fileobj is not sock:
            # A socket closed without being forgotten (a test's stand-in for a killed
            # process) left its number behind, and the kernel gave it to this one.
            self._selector.unregister(fd)
            key = None
        if key is None:
            self._selector.register(sock, events, client)
        else:
            self._selector.modify(sock, events, client)
        if wait is not None:
            self.after(client, wait)
        else:
            client._timer += 1

    def after(self, client: PresenceClient, wait: float) -> None:
        """``client``'s state expires in ``wait`` seconds (its older deadline is void)."""
        client._timer += 1
        deadline = time.monotonic() + wait
        heapq.heappush(self._timers, (deadline, next(self._order), client._timer, client))

    def forget(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)

    def drop(self, client: PresenceClient) -> None:
        self._clients.discard(client)

    def _run(self) -> None:
        while True:
            wait = None
            if self._timers:
                wait = max(0.0, self._timers[0][0] - time.monotonic())
            for key, _ in self._selector.select(wait):
                if key.data is None:
                    with contextlib.suppress(OSError):
                        self._wake_in.recv(4096)
                elif key.data in self._clients:
                    self._turn(key.data._ready)
            with self._lock:
                incoming, self._incoming = self._incoming, []
            for client in incoming:
                if client not in self._clients and client._state != _ENDED:
                    self._clients.add(client)
                    self._turn(client._begin)
                if client._stop.is_set() and client in self._clients:
                    self._turn(client._stopped)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                _, _, timer, client = heapq.heappop(self._timers)
                if timer == client._timer and client in self._clients:
                    self._turn(client._expired)

    def _turn(self, step: Callable[[_Loop], None]) -> None:
        try:
            step(self)
        except Exception:  # one connection's bug ends that connection, not the thread
            log.exception("a presence connection failed")
            client = step.__self__  # type: ignore[attr-defined]
            client._end(self)


_the_loop: _Loop | None = None
_the_loop_lock = threading.Lock()


def _loop() -> _Loop:
    """The process's presence thread, started with its first connection."""
    global _the_loop
    with _the_loop_lock:
        if _the_loop is None:
            _the_loop = _Loop()
        return _the_loop


def _forget_loop() -> None:
    """A forked child has none of its parent's threads: it starts its own. (Said at the
    fork, not checked with ``getpid`` on every call: a syscall per connection.)"""
    global _the_loop, _the_loop_lock
    _the_loop, _the_loop_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_loop)
