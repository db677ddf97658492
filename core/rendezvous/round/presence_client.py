"""A member's end of presence (``presence.py``): one connection to a serving rank's
agent, answering its challenge with our hello; it tells the member when that rank's
process is gone (its connection closed unasked and its port refuses us), when it left on
purpose (``bye``), when it says the round's facts changed (``news``), and which
heartbeat value it last had acknowledged (``beat``)."""

from __future__ import annotations

import contextlib
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
from elastic.core.tcpstore.dial import dial


class PresenceClient:
    """A member's end: one connection to a serving rank's agent; ``on_gone()`` once when
    its process is gone (its connection closed unasked and did not come back),
    ``on_bye()`` once when it said goodbye (it left on purpose), ``on_news()`` each time it
    says the round's facts changed."""

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
        self._sock: socket.socket | None = None
        self._refused = False  # the last connect failed because nothing listened
        self._goodbye = BYE
        # The serving rank's last ``beat``: (the value, when it arrived; monotonic).
        self.beat: tuple[bytes, float] | None = None
        self._thread = threading.Thread(target=self._run, name="rdzv-presence-client", daemon=True)
        self._thread.start()

    def stop(self, leaving: bool = False) -> None:
        """Leave on purpose: say goodbye, so rank 0 never takes this for a death;
        ``leaving``: this node left the job and published it (``LEFT``)."""
        self._stop.set()
        self._goodbye = LEFT if leaving else BYE
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.sendall(self._goodbye)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

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

    def _connect(self) -> socket.socket | None:
        """A connection to rank 0's port with our hello sent in answer to its challenge;
        None when that failed (``_refused``: because rank 0's host answered that nothing
        listens there)."""
        self._refused = False
        try:
            sock = dial(*self._target, HELLO_WAIT)
        except ConnectionRefusedError:
            self._refused = True
            return None
        except OSError:
            return None
        try:
            nonce = _read_challenge(sock)
            if nonce is None:
                sock.close()
                return None
            sock.sendall(self._hello(nonce))
            sock.settimeout(None)
            return sock
        except OSError:
            sock.close()
            return None

    def _run(self) -> None:
        # The serving rank named this port when it joined the round, so it listened
        # then: a refusal from the first connect on is its process gone (it died after
        # joining, before we connected), judged as a closed connection is.
        sock = self._connect() or self._come_back(refused=self._refused)
        buf = b""
        while sock is not None:
            self._sock = sock
            if self._stop.is_set():  # stopped while connecting: goodbye, then close
                with contextlib.suppress(OSError):
                    sock.sendall(self._goodbye)
                sock.close()
                return
            try:
                data = sock.recv(4 * LINE_MAX)
            except OSError:
                data = b""
            *lines, buf = (buf + data).split(b"\n")
            buf = buf[-LINE_MAX:]  # no word is longer: the rest of a longer line is junk
            if data and not any(BYE.strip() in line for line in lines):
                if any(NEWS.strip() in line for line in lines):
                    self._on_news()
                beats = [v for v in map(beat_value, lines) if v is not None]
                if beats:
                    self.beat = (beats[-1], time.monotonic())
                continue
            sock.close()
            if self._stop.is_set() or data:  # we stopped, or it left on purpose
                return None if self._stop.is_set() else self._on_bye()
            sock = self._come_back(refused=True)

    def _come_back(self, refused: bool) -> socket.socket | None:
        """A new connection within ``BLIP_GRACE``; None after ``on_gone()`` when every
        try (and, with ``refused``, the one before them) was refused."""
        deadline = time.monotonic() + BLIP_GRACE
        sock = None
        while sock is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.05)
            sock = self._connect()
            refused = refused and self._refused
        if sock is None and refused and not self._stop.is_set():
            # Only refusals say the serving rank's process is gone. A connect that timed
            # out (a rank too busy to accept, a partition) says nothing: the heartbeats
            # judge it.
            self._on_gone()
        return sock


def _read_challenge(sock: socket.socket) -> str | None:
    """Rank 0's challenge, the first line on a new connection (the socket's timeout
    bounds the wait); None when what came is not one (not our presence port)."""
    line = b""
    while not line.endswith(b"\n") and len(line) <= NONCE_LEN:
        chunk = sock.recv(NONCE_LEN + 1 - len(line))
        if not chunk:
            return None
        line += chunk
    nonce = line.strip()
    if len(nonce) != NONCE_LEN or not all(c in b"0123456789abcdef" for c in nonce):
        return None
    return nonce.decode()
