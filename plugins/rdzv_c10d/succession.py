"""Where a c10d job's store is, and how it moves: the backend's succession policy.

One agent holds the job's store at a time: at start the one whose machine owns the first
``--rdzv-endpoint``, after a move the member whose standby store took it. Every other
agent keeps an empty standby store and publishes its address in its join records; a
formed round's outcome names the first standbys in rank order (``Assignment.successors``).

**Marks.** A standby holds ``STANDBY_KEY``: ``IDLE`` while it waits, ``LEAVING`` once its
agent leaves, ``RECEIVING <sender>`` while a holder copies the job's keys into it; the key
is deleted last, when the copy is the job's store. A holder chooses a successor with a
compare_set ``IDLE -> RECEIVING <sender>`` on that standby, and a leaving agent marks its
own with a compare_set ``IDLE -> LEAVING``: on one key of one store, so exactly one of the
two wins. A leaving node is never chosen; one chosen just before it began to leave
finishes receiving and hands the store on itself (``handler.leave``).

**Identity.** Every store of a run holds ``identity_key(run_id)``: ``"<generation>
<nonce>"``. The first store's is generation 0, written by its first client (compare_set
from absent, so every agent reads the same); a handover writes generation + 1 and a new
nonce into the copy before the copy is marked live. The agents' connections share what
they know (``Succession``) and accept a store only with a higher generation than the
newest they saw, or the same generation and nonce: a store of another run, an older one,
or a new empty one opened where the first stood (generation 0, another nonce) is refused,
by every agent that ever reached the run's store.

**Only ever one store serves a run.** A client uses a store only when it carries no mark
and an identity it accepts. (1) A holder marks its successor ``RECEIVING`` before it stops
serving, stops serving (its loop has ended: no request is applied after) before it copies,
and unmarks the successor only after the copy: its store and the copy never both answer
unmarked. (2) The copy's generation is higher: a client that used it never goes back to
an older store, whatever answers at that address later. (3) One sender per copy: the
successor's mark is a compare_set from ``IDLE``, and a holder hands over once (a lock);
a sender that dies mid-copy leaves it ``RECEIVING`` for good, never accepted: the clients
wait ``HANDOVER_WAIT`` for it, then the store is lost and the job ends with one line.
(4) An agent that could host the first endpoint listens first and then looks at the other
candidate endpoints; it serves only when none of them holds or receives this run's store.
The old holder closed its listener only after marking its successor, so if the new agent
could listen, the mark is visible to it: a handover to a candidate endpoint is never
missed. (5) A store that moved to a standby on no candidate endpoint (none was named, or no
member owns one) cannot be seen by an agent that knows only the endpoints; one started on
the first endpoint's host (a replacement) opens a new store there, which the run's holder
redirects before a round forms on it (``redirect.py``), and the run's agents never accept
it (another nonce). **The limit**: an agent on another host that was in no formed round
(a late joiner, a standby of a full job) finds nobody at the first endpoint, waits for it
(``read_timeout``) and exits with one line. Name every host that may hold the store in
``--rdzv-endpoint=h0:p,h1:p,...``.

**Writes across a move.** A SET has no answer in TCPStore's protocol: on a store that can
move, ``Connection`` follows it with a request that does answer (``view.py``), so a SET the
old holder never applied is sent again to the new one (REPEATABLE), and an ADD whose
answer was lost fails to its caller: applied once, or an error, never dropped silently.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from typing import overload

from elastic.core.interfaces.rendezvous import (
    RendezvousAuthError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousStoreGoneError,
)
from elastic.core.rendezvous import net
from elastic.core.tcpstore import TCPStoreClient, wire
from elastic.core.tcpstore.view import Connection
from elastic.plugins.rdzv_c10d.store import parse_endpoint

log = logging.getLogger(__name__)

STANDBY_KEY = "elastic/standby"
IDLE, LEAVING, RECEIVING = b"idle", b"leaving", b"receiving"
# How long a handover in progress (a standby ``RECEIVING``) is waited for: copying the
# keys takes milliseconds for small jobs, about a second for a thousand nodes.
HANDOVER_WAIT = 10.0
PROBE_TIMEOUT = 2.0  # s for a standby (or a candidate endpoint) to answer a probe
# Candidates probed at once when the store stopped answering: a cut-off one is silent for
# PROBE_TIMEOUT, and probed one after another it held up the search past a lease (4 s).
PROBE_THREADS = 8
REPROBE = 0.05  # s between a candidate's probes while a handover is under way
SETTLE = 0.2  # s the other candidates get to answer once one holds the run's store

Identity = tuple[int, str]  # (generation, nonce)
Probed = tuple[bytes, "Identity | None", TCPStoreClient]  # a store's mark, identity, a client


def identity_key(run_id: str) -> str:
    return f"elastic/{run_id}/store-identity"


def new_identity(generation: int) -> bytes:
    return f"{generation} {secrets.token_hex(8)}".encode()


def parse_identity(raw: bytes) -> Identity | None:
    """``"<generation> <nonce>"``; None when absent or malformed (not a store of ours)."""
    try:
        generation, nonce = raw.decode("ascii").split(" ")
        return int(generation), nonce
    except (UnicodeDecodeError, ValueError):
        return None


def wire_key(key: str) -> bytes:
    """``key`` as a server holds it (what a client sends for it)."""
    return (wire.KEY_PREFIX + key).encode()


def receiving(mark: bytes) -> bool:
    return mark.startswith(RECEIVING)


class Succession:
    """What a handler's connections know of the run's store: its identity (the newest
    seen) and where it may move (``successors``). Installed as each ``Connection``'s
    ``locator``: ``accept`` checks every new connection, ``find`` looks for a moved store."""

    def __init__(self, run_id: str, candidates: list[tuple[str, int]], token: bytes | None):
        self.key = identity_key(run_id)
        self.run_id = run_id
        self._token = token
        self._lock = threading.Lock()
        self.known: Identity | None = None
        # The first endpoint is never a successor: no standby is kept there, and what
        # answers there after a move is the old store's address, not the new one.
        self._first = candidates[0]
        self.successors: Sequence[tuple[str, int]] = candidates[1:]
        # A moved store the run's holder named in a new store opened at the first
        # endpoint (``redirect.py``): looked at first once that store stops.
        self.redirect: tuple[str, int] | None = None

    def learn(self, raw: bytes) -> None:
        found = parse_identity(raw)
        with self._lock:
            if found is not None and (self.known is None or found[0] >= self.known[0]):
                self.known = found

    def acceptable(self, found: Identity | None) -> bool:
        with self._lock:
            known = self.known
        if known is None:
            return True
        if found is None:
            return False
        return found[0] > known[0] or found == known

    def accept(self, client: TCPStoreClient) -> None:
        """Raise ``RendezvousStoreGoneError`` unless ``client``'s store is this run's
        (see the module): asked of every connection made after the first contact."""
        with self._lock:
            known = self.known
        if known is None:
            return
        raw = client.multi_get([self.key], False)[0] if client.check([self.key]) else b""
        found = parse_identity(raw)
        if not self.acceptable(found):
            said = f"generation {found[0]}" if found else "no identity of this run"
            raise RendezvousStoreGoneError(
                f"the store at {client.where} is not run {self.run_id!r}'s ({said}; the run's "
                f"is generation {known[0]}): it was opened anew where the run's stood"
            )
        self.learn(raw)

    def probe(self, host: str, port: int) -> Probed | None:
        """(its mark, its identity of this run, a client on it) for the store at
        host:port; None when nothing answers there."""
        try:
            client = TCPStoreClient(host, port, PROBE_TIMEOUT, token=self._token)
        except (RendezvousConnectionError, RendezvousAuthError):  # nothing, or not ours
            return None
        try:
            mark, raw = client.multi_get([STANDBY_KEY, self.key], False)
        except RendezvousConnectionError:
            client.close()
            return None
        return mark, parse_identity(raw), client

    def find(self, conn: Connection) -> tuple[str, int, TCPStoreClient] | None:
        """Where the store moved after ``conn``'s stopped answering: the unmarked store of
        the highest acceptable generation among the successors. They are probed at once,
        each again as soon as its last probe ended, so a host that is cut off (silent for
        ``PROBE_TIMEOUT``) delays no other. None once every one was heard from and none
        is receiving (it did not move: its holder died), after ``HANDOVER_WAIT`` when a
        handover never ends."""
        here = (conn.host, conn.port)
        redirect = [self.redirect] if self.redirect is not None else []
        candidates = [
            c for c in dict.fromkeys([*redirect, *self.successors]) if c not in (here, self._first)
        ]
        if not candidates:
            return None
        workers = min(len(candidates), PROBE_THREADS)
        pool = futures.ThreadPoolExecutor(workers, thread_name_prefix="store-probe")
        try:
            return self._search(pool, candidates, conn)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _search(
        self,
        pool: futures.ThreadPoolExecutor,
        candidates: list[tuple[str, int]],
        conn: Connection,
    ) -> tuple[str, int, TCPStoreClient] | None:
        deadline = time.monotonic() + HANDOVER_WAIT
        flying: dict[futures.Future[Probed | None], tuple[str, int]] = {}
        heard: set[tuple[str, int]] = set()
        moving: set[tuple[str, int]] = set()  # those receiving the store when last probed
        try:
            while time.monotonic() < deadline and not conn.closed:
                busy = set(flying.values())
                for candidate in candidates:
                    if candidate not in busy:
                        flying[pool.submit(self.probe, *candidate)] = candidate
                done, _ = futures.wait(
                    list(flying), deadline - time.monotonic(), futures.FIRST_COMPLETED
                )
                if any(self._holds_the_store(f.result()) for f in done):
                    # Of the run's stores, the newest: let the others answer too (one cut
                    # off does not in this time, and cannot be the store anyway).
                    more, _ = futures.wait([f for f in flying if f not in done], SETTLE)
                    done |= more
                answers = []
                for future in done:
                    candidate = flying.pop(future)
                    heard.add(candidate)
                    moving.discard(candidate)
                    found = future.result()
                    if found is not None:
                        answers.append((candidate, found))
                        if receiving(found[0]):
                            moving.add(candidate)
                newest = self._newest(answers)
                if newest is not None:
                    return newest
                if len(heard) == len(candidates) and not moving:
                    return None
                time.sleep(REPROBE)
            return None
        finally:
            for future in flying:  # probes still under way: their clients are nobody's
                future.add_done_callback(_close_probed)

    def _holds_the_store(self, found: Probed | None) -> bool:
        """Whether a probe found an unmarked store this node accepts as the run's."""
        if found is None or found[0] or found[1] is None:
            return False
        return self.acceptable(found[1])

    def _newest(
        self, answers: list[tuple[tuple[str, int], Probed]]
    ) -> tuple[str, int, TCPStoreClient] | None:
        """Of the stores that answered, the run's of the highest generation (the first on
        a tie); every other answer's client is closed."""
        held = [(f[1], where, f[2]) for where, f in answers if self._holds_the_store(f)]
        best = max(held, key=lambda h: h[0][0] if h[0] else -1, default=None)
        for _, found in answers:
            if best is None or found[2] is not best[2]:
                found[2].close()
        if best is None:
            return None
        ident, (host, port), client = best
        assert ident is not None  # _holds_the_store
        self.learn(f"{ident[0]} {ident[1]}".encode())
        return host, port, client

    def serving_elsewhere(self) -> bool:
        """Whether another candidate endpoint holds this run's store, or is receiving
        it: the first endpoint's holder handed it over, and a store opened there now
        would be a second one (see the module)."""
        for host, port in self.successors:
            found = self.probe(host, port)
            if found is None:
                continue
            mark, ident, client = found
            client.close()
            if receiving(mark) or (not mark and ident is not None):
                return True
        return False


class Successors(Sequence[tuple[str, int]]):
    """Where the store may have moved: the candidate endpoints but the first, then the
    round's first standbys in rank order (``Assignment.successors``). Worked out on first
    use, when a connection looks for a moved store: nobody parses them while it stays."""

    def __init__(self, candidates: list[tuple[str, int]], standbys: list[str]) -> None:
        self._candidates, self._standbys = candidates[1:], standbys
        self._endpoints: list[tuple[str, int]] | None = None

    def _all(self) -> list[tuple[str, int]]:
        if self._endpoints is None:  # two threads may both parse: the same result
            self._endpoints = list(dict.fromkeys([*self._candidates, *endpoints(self._standbys)]))
        return self._endpoints

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[str, int]]: ...
    def __getitem__(self, index: int | slice) -> tuple[str, int] | Sequence[tuple[str, int]]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())


def endpoints(standbys: object) -> list[tuple[str, int]]:
    """The ``host:port`` strings of ``standbys`` that parse, in order."""
    parsed = []
    for standby in standbys if isinstance(standbys, list) else []:
        if not isinstance(standby, str):
            continue
        try:
            parsed.append(parse_endpoint(standby))
        except RendezvousConfigError:  # "" (none), or not an endpoint: skipped
            continue
    return parsed


def order_successors(
    standbys: list[str], candidates: list[tuple[str, int]], mine: str
) -> list[str]:
    """Whom to offer the store, in order: standbys on a candidate endpoint first (a node
    joining later finds the store there), then the round's in rank order; never our own."""
    named = {net.join_host_port(h, p) for h, p in candidates}
    ordered = [s for s in dict.fromkeys(standbys) if s and s != mine]
    ordered.sort(key=lambda s: s not in named)
    return ordered


def _close_probed(future: futures.Future[Probed | None]) -> None:
    if not future.cancelled() and future.exception() is None:
        found = future.result()
        if found is not None:
            found[2].close()
