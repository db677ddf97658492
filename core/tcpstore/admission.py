"""Who our TCPStore server serves, and what it grants a connection that has not yet
proved the job token.

With a token, every connection starts as a *stranger*: it may validate, ping and do the
token handshake (``wire``: both sides prove the token, the server first), nothing else,
and only within a small budget: ``STRANGER_REQUESTS`` requests, ``STRANGER_BYTES``
bytes and ``limits.HANDSHAKE_WAIT`` seconds; beyond any of them it is dropped. Strangers
have a cap of their own, ``MAX_STRANGERS``, apart from the members': a new one beyond it
pushes out the oldest stranger if that one had ``STRANGER_GRACE`` to prove the token
(a member needs a round trip or two), else it is closed at once and our client tries
again, as with a busy store. A flood of strangers never takes the members' slots and
cannot hold the strangers' for long; a burst of members connecting at once (a large job
starting) is let in as fast as handshakes complete, not pushed out mid-handshake. A connection
that proved the token is a *member* and is served as a store is, without a budget: a
flood of strangers pipelining requests costs a member at most one pass of the loop over
a few hundred bytes each.

A server that must also serve torch's own clients, which cannot prove anything (the
``static`` backend: the workers' store is the agents'), names the keys only members may
touch (``members_only``): a connection that sends any other request before proving the
token becomes a *guest*, served in full except for those keys, and without a budget
(torch's clients send large requests). Such a store cannot keep strangers from slowing
it; the backend says so when it listens beyond loopback.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from typing import Generic, Protocol, TypeVar

from elastic.core.tcpstore import wire
from elastic.core.tcpstore.limits import LimitLog
from elastic.core.tcpstore.wire import Query

log = logging.getLogger(__name__)

# Connections yet to prove the token, at once. A member needs one for a round trip or
# two; a flood of 32 strangers leaves most of them to members connecting meanwhile.
MAX_STRANGERS = 256
# Seconds a stranger keeps its slot at the cap before a newcomer may push it out: a
# member's handshake takes milliseconds, a second on a machine starved of CPU.
STRANGER_GRACE = 1.0
# Requests before the token is proved: VALIDATE, PING, AUTH_HELLO and AUTH_PROOF are
# four; the rest is slack for a client that pings again.
STRANGER_REQUESTS = 8
# Bytes before the token is proved: those four requests are 92 bytes.
STRANGER_BYTES = 256
_INTRUDERS_NAMED = 100  # client hosts warned about by name, at most


class Refused(Exception):
    """Close this connection; ``limit``: the budget or cap it went beyond (logged once),
    None for a protocol violation (logged at debug level)."""

    def __init__(self, what: str, limit: str | None = None) -> None:
        super().__init__(what)
        self.limit = limit


class Peer(Protocol):
    """What admission reads and sets on one of the server's connections."""

    peer: str
    authenticated: bool
    guest: bool
    challenge: tuple[bytes, bytes] | None
    deadline: float | None
    parser: wire.RequestParser


C = TypeVar("C", bound=Peer)


class Admission(Generic[C]):
    """The rules of one server: ``token`` (None: every connection is a member at once)
    and ``members_only`` (a key prefix: torch's clients are served as guests outside it;
    None: a connection that does not prove the token gets nothing)."""

    def __init__(
        self, token: bytes | None, limits: LimitLog, members_only: bytes | None = None
    ) -> None:
        self.token = token
        self.members_only = members_only
        self._limits = limits
        # Strangers under a budget, oldest first: [bytes received, requests, arrived at].
        self._strangers: dict[C, list[float]] = {}
        self._intruders: set[str] = set()  # client hosts that failed to prove it

    @property
    def budgeted(self) -> bool:
        """Whether strangers have a budget (a token, and no guests to serve)."""
        return self.token is not None and self.members_only is None

    def cap_count(self, open_now: int) -> int:
        """What counts against the members' connection cap with ``open_now`` open: the
        members, and the room strangers may take (theirs, not the members')."""
        if not self.budgeted:
            return open_now
        return open_now - len(self._strangers) + MAX_STRANGERS

    def request_limit(self) -> int:
        """The largest request a validated connection may send before it proves the
        token: the handshake's, unless it may be a guest (torch's client's requests)."""
        return wire.AUTH_REQUEST_LEN if self.members_only is None else wire.MAX_REQUEST_LEN

    def arrived(self, conn: C) -> C | None:
        """A new connection; returns the one to drop at the strangers' cap, if any: the
        oldest stranger once it had its grace, else ``conn`` itself."""
        if not self.budgeted:
            return None
        now = time.monotonic()
        self._strangers[conn] = [0, 0, now]
        if len(self._strangers) <= MAX_STRANGERS:
            return None
        oldest = next(iter(self._strangers))
        if now - self._strangers[oldest][2] < STRANGER_GRACE:
            oldest = conn
        self._limits.hit(
            "MAX_STRANGERS",
            f"{MAX_STRANGERS} connections have not proved the token; dropping one",
        )
        return oldest

    def left(self, conn: C) -> None:
        self._strangers.pop(conn, None)

    def recv_size(self, conn: C, size: int) -> int:
        """How much to read from ``conn`` at once: a stranger never more than its budget."""
        return STRANGER_BYTES + 1 if conn in self._strangers else size

    def charge(self, conn: C, received: int = 0, requests: int = 0) -> None:
        """Count bytes or requests against a stranger's budget; ``Refused`` past it."""
        spent = self._strangers.get(conn)
        if spent is None:
            return
        spent[0] += received
        spent[1] += requests
        if spent[0] > STRANGER_BYTES:
            raise Refused(f"over {STRANGER_BYTES} bytes before proving the token", "STRANGER_BYTES")
        if spent[1] > STRANGER_REQUESTS:
            raise Refused(
                f"over {STRANGER_REQUESTS} requests before proving the token", "STRANGER_REQUESTS"
            )

    def admits(self, conn: C, req: wire.Request) -> bool:
        """Whether ``req`` (not VALIDATE, PING or AUTH_*) is served to ``conn``: a member,
        or a guest away from the members' keys (one that is not is refused). False: the
        connection must prove the token first (``handshake`` refuses it)."""
        if not conn.authenticated:
            if self.members_only is None or conn.challenge is not None:
                return False  # a handshake begun must be finished
            conn.authenticated = conn.guest = True  # torch's client: served as a guest
            admit(conn)
        if conn.guest and self.members_only is not None:
            keys = [req.key, *req.keys, *(key for key, _ in req.pairs)]
            if any(key.startswith(self.members_only) for key in keys):
                self._warn_intruder(conn.peer)
                raise Refused(f"{req.query.name} of a key only members may touch")
        return True

    def handshake(self, conn: C, req: wire.Request) -> bytes:
        """The answer to AUTH_HELLO or AUTH_PROOF (see ``wire``); any other request of a
        connection that has not proved the token is refused."""
        if req.query is Query.AUTH_HELLO and conn.challenge is None and not conn.guest:
            if self.token is None:
                return wire.blob(b"") + wire.blob(b"")  # this server takes no token
            ours = secrets.token_bytes(wire.AUTH_CHALLENGE_LEN)
            conn.challenge = (req.value, ours)
            proof = wire.auth_proof(self.token, wire.SERVER, req.value, ours)
            return wire.blob(ours) + wire.blob(proof)
        if req.query is Query.AUTH_PROOF and self.token is not None and conn.challenge:
            expected = wire.auth_proof(self.token, wire.CLIENT, *conn.challenge)
            if not hmac.compare_digest(req.value, expected):
                self._warn_intruder(conn.peer)
                raise Refused("a wrong token")
            conn.authenticated = True
            self.left(conn)
            admit(conn)
            return wire.U8.pack(wire.AUTHENTICATED)
        raise Refused(f"{req.query.name} before proving the token")

    def _warn_intruder(self, peer: str) -> None:
        """One line per client host (bounded), so a client retrying cannot flood the log."""
        host = peer.rpartition(":")[0]
        if host in self._intruders or len(self._intruders) >= _INTRUDERS_NAMED:
            return
        self._intruders.add(host)
        log.warning(
            "%s: a client at %s does not hold the job token; refused (said once per host)",
            self._limits.who,
            host,
        )


def admit(conn: Peer) -> None:
    """Its handshake is done: full-size requests, and no deadline until one begins."""
    conn.parser.max_len = wire.MAX_REQUEST_LEN
    conn.deadline = None  # the next request's own starts with its first byte
