"""``Lease``: this node's keep-alives, and the one fencing rule every backend shares.

The rule is the lease of etcd and Chubby. A node is a member of its round while the store
has acknowledged a keep-alive *sent* less than ``length`` ago; once that is no longer
true it fences (stops its workers) and stays fenced for the round. ``length`` is
``heartbeat_timeout`` minus ``STOP_MARGIN`` (4 s of the default 5 s).

Why the node fences at least ``STOP_MARGIN`` before any peer may declare it lost. A
keep-alive writes a new value to the node's heartbeat key. A peer declares the node lost
only after a read it *issued* at least ``heartbeat_timeout`` after it first *received*
the value it still reads (``liveness.LivenessTracker``). Say that value was written by
keep-alive k, sent at s_k. The peer received it after the store applied it, so after
s_k: the peer's clock starts no earlier than s_k, and its verdict comes no earlier than
s_k + heartbeat_timeout. And since that read still returns k's value, no later keep-alive
had been applied when it was issued, so none had been acknowledged either: the newest
keep-alive the node could have seen acknowledged by then is k or an older one, and its
lease ran out by s_k + length = s_k + heartbeat_timeout - STOP_MARGIN. Only durations are
compared (each on its own monotonic clock), never two machines' clocks. The judge runs
when the lease ends and tells the agent at once (``on_expired``, through the monitor's
``on_fenced``): the agent's fence guard signals the workers from that thread and SIGKILLs
them ``kill_grace`` (a third of ``STOP_MARGIN``) later from a timer, whatever its main
loop is doing (a store call, a grace, a poll interval), so they are gone two thirds of
``STOP_MARGIN`` before the verdict, and a new round forms only after it (the verdict has
to be published and seen first). The rule counts nothing but the store's answers: a tick that
runs late, a log write or a WAIT on another connection never fences anyone; keep-alives
have a connection and a thread of their own.

Jeopardy: a store that is slow is not a store that is gone. When the lease runs out while
a keep-alive is on its way and the store's *host* still acknowledges this connection's
packets (``CoordinationStore.peer_silence``: TCP acknowledgements from its kernel,
keepalive probes included, within ``HOST_HEARD_WITHIN``), the keep-alive has reached the
store and waits in its input: its process is paused or starved of CPU. The node then
waits for the answer instead of fencing. Why that cannot let two worlds train at once: a
store that serves nobody (paused) answers no peer either; one that serves connections in
turn (ours and torch's TCPStore servers answer every connection with input on each round
of their event loop) applies our waiting keep-alive before it answers any read a peer
sends after that round. A peer has one read in flight at a time, so while we wait it gets
at most one more answer with our old value; before, it had at most two (the value was at
most a keep-alive period old when the next one reached the store), and a verdict needs
at least three reads after the first that found the value unchanged
(``LivenessTracker.min_reads``). Only a connection the store has answered counts (a
client is connected once its handshake was answered; the kernel also acknowledges data in
the accept queue of a server that never reads it), and a connection being made again
never does. The exception needs one connection to the one store: an etcd cluster has
other members that may serve a peer while ours is stuck, and its adapters (connection
pools) report no ``peer_silence``, so on etcd the lease alone decides. The wait is bounded
by the keep-alive connection's ``read_timeout`` (10 s by default): a call still
unanswered then is given up and its connection made again, which ends the jeopardy. (A
longer bound would ride out longer pauses, but a call stuck across a partition then
waits for TCP's retransmission backoff after the heal, and delays the node's return.)

A round's outcome is an acknowledgement too. The request that brought it (a waiter's
WAIT, the coordinator's publishing) was sent before the outcome existed, and was
answered; every peer's clock for this node's heartbeat in the new round starts at a read
made after the outcome existed, so a lease counted from that send ends at least
``STOP_MARGIN`` before any verdict, by the argument above. A node that waited less than
the lease therefore starts its round without a keep-alive round trip of its own, and
that request counts as its last keep-alive sent: the keep-alive thread sends the next a
period after it. A round's members return one round trip sooner, and a thousand of them
neither queue for a keep-alive nor send one each at the instant the round forms (the
store answers their outcome reads and presence connections meanwhile).

Once fenced the node stays fenced until its next round (``arm``): an acknowledgement that
arrives after the lease ran out proves nothing about the time in between, when a peer may
have declared the node lost.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from elastic.core.interfaces.coordination import HOST_HEARD_WITHIN, CoordinationStore
from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousStoreGoneError,
)
from elastic.core.rendezvous.round.judges import JUDGES

log = logging.getLogger(__name__)

# How much sooner than the peers' verdict (heartbeat_timeout) a node fences: time for its
# workers to be signalled, given a grace and killed (``Lease.kill_grace``).
STOP_MARGIN = 1.0
# How often the judge looks again while the lease is in jeopardy (run out, store slow).
JEOPARDY_POLL = 0.1


def lease_length(heartbeat_timeout: float) -> float:
    """Seconds from a keep-alive's send to the end of the lease it renews."""
    return heartbeat_timeout - min(STOP_MARGIN, heartbeat_timeout / 2)


class Expiry(NamedTuple):  # a named tuple: see AttemptEnd in core/agent/outcome.py
    """Why the lease ran out: how long no keep-alive had been acknowledged then; ``term``:
    what ``arm`` was given for the round it ran out in."""

    silent: float
    term: int = -1


class Lease:
    """Keep-alives on ``store`` (its own connection) to ``key`` every ``period`` s, from a
    daemon thread, and a judge that decides when the lease ran out (run by the process's
    one judge thread, ``judges.JUDGES``)."""

    def __init__(self, store: CoordinationStore, key: str, interval: float, timeout: float):
        self.store = store
        self.key = key
        self.timeout = timeout
        self.length = lease_length(timeout)
        # The workers' SIGTERM-to-SIGKILL grace once fenced: they are gone two thirds of
        # the margin before any peer's verdict, the last third for the signals and exits.
        self.kill_grace = (timeout - self.length) / 3
        # Called on the judge's thread the moment the lease runs out (once per term).
        self.on_expired: Callable[[Expiry], None] | None = None
        # Called on the keep-alive's thread with the value each acknowledged one wrote
        # (the monitor says it on the presence connection: ``presence.BEAT``).
        self.on_acked: Callable[[bytes], None] | None = None
        self._term = -1
        self._told: Expiry | None = None
        # At least three keep-alives per lease: one late or lost answer never ends it.
        self.period = min(interval, self.length / 3)
        self._lock = threading.Lock()
        # Notified when a keep-alive's request ends (answered or failed): ``join``.
        self._answered = threading.Condition(self._lock)
        self._sending = 0  # keep-alives whose request is on its way
        self._stop = threading.Event()
        self._wake_keeper = threading.Event()
        self._seq = 0
        self._acked_sent: float | None = None  # send time of the newest acknowledged one
        self._in_flight: float | None = None  # send time of the one awaiting its answer
        self._last_sent: float | None = None  # send time of the newest one, answered or not
        self._urgent = False  # send the next one at once (a wait in jeopardy goes on)
        self._armed = False  # judged only while this node is a member of a round
        # A member whose lease was stale at ``arm``: armed once its keep-alive is answered.
        self._arming = False
        self._expired: Expiry | None = None
        self._beating = True
        # Quiet until the node is a member of a round (``arm``) or coordinates one: until
        # then nobody reads its heartbeat.
        self._quiet = True
        # The keep-alive thread sleeps until woken (it was idle when it last looked): the
        # judge wakes it when a round's first keep-alive is due (``arm``).
        self._keeper_asleep = False
        self._slow_noted = False  # said once per episode that the store is only slow
        self.error: Exception | None = None  # final: the store is gone or corrupt
        self._thread: threading.Thread | None = None

    # -- control --------------------------------------------------------------------
    def start(self, name: str) -> None:
        """The keep-alive thread and the judge. The first keep-alive goes out when this
        node stops being quiet: it coordinates a round, or one with it formed (``arm``);
        on the way to its first round a node sends none (a thousand nodes joining at once
        are a thousand round trips or more fewer)."""
        if self._thread is not None:
            return
        # A store that cannot tell a slow store from a gone one (no ``peer_silence`` on a
        # connection in use: etcd) has no jeopardy, so it gets keep-alives twice as
        # often: a pause up to the lease minus half an interval (3.5 s by default)
        # fences nobody there either.
        if self.store.peer_silence() is None:
            self.period /= 2
        self._thread = threading.Thread(
            target=self._keep, name=f"rdzv-keepalive-{name}", daemon=True
        )
        self._thread.start()
        JUDGES.add(self, self._judge_step)

    def stop(self) -> None:
        self._stop.set()
        self._wake_keeper.set()
        JUDGES.remove(self)

    def join(self, timeout: float) -> None:
        """After ``stop``: wait (up to ``timeout`` s) for a keep-alive already on its way
        to land before the caller's last write to the key (a beat answered after "done"
        would replace it: TCPStore's heartbeat overwrites what it does not expect). None
        starts after ``stop`` (``renew``), so with none on its way this returns at once,
        not after the keep-alive thread woke to end."""
        with self._answered:
            self._answered.wait_for(lambda: self._sending == 0, timeout)

    def suspend(self) -> None:
        """Stop sending keep-alives (how tests make a node look hung)."""
        self._beating = False

    def set_quiet(self, quiet: bool) -> None:
        """No keep-alives while quiet (a node waiting for a round to form, or one that
        never was a member); once that ends the next goes out a period after the last."""
        self._quiet = quiet
        if not quiet:
            self._wake_keeper.set()

    def arm(self, member: bool, outcome_sent: float | None = None, term: int = -1) -> None:
        """A round with this node in it formed (``member``), or none is running. A new
        round starts unfenced. The request that brought the round's outcome, sent at
        ``outcome_sent`` and answered, counts as an acknowledged keep-alive (see the
        module), and as the last one sent: the next goes out a period after it. A lease
        stale even so (a long wait) is renewed first, so the round does not start
        fenced: by the keep-alive thread, at once, and the judge starts once that is
        answered (or failed), as if the caller had waited for it; the caller does not.
        The keep-alives go on from there, a period after the last.
        ``term`` (the round) goes with an expiry, so a late one is never taken for the
        next round's."""
        with self._lock:
            self._expired = None
            self._armed = False
            self._term = term
            if outcome_sent is not None and (
                self._acked_sent is None or outcome_sent > self._acked_sent
            ):
                self._acked_sent = outcome_sent
            if outcome_sent is not None and (
                self._last_sent is None or outcome_sent > self._last_sent
            ):
                self._last_sent = outcome_sent  # the next keep-alive: a period after it
            stale = self._acked_sent is None or self._left(time.monotonic()) < self.period
            self._armed = member and not stale
            self._arming = member and stale
            if self._arming:
                self._urgent = True  # the keep-alive thread renews it now (``renew``)
            if member:
                self._quiet = False
            # Nothing to judge yet (a fresh lease, or none): the judge is planned for
            # when it is next due, as its own step would plan it, without waking it.
            due, keep_now = self._plan(time.monotonic())
            keep_now = keep_now or self._arming
        if keep_now:
            self._wake_keeper.set()
        # Otherwise the judge wakes the keep-alive thread when the round's first one is
        # due (``_judge_step``), not now: a thousand members of one process returning
        # from their round together would wake a thousand threads for nothing.
        JUDGES.plan(self, due)

    # -- what the round reads ---------------------------------------------------------
    def expired(self) -> Expiry | None:
        with self._lock:
            self._judge(time.monotonic())
            expired = self._expired
        self._tell()
        return expired

    def _tell(self) -> None:
        """Hand a new expiry to ``on_expired`` (outside the lock: it signals workers)."""
        with self._lock:
            expired = self._expired
            if expired is None or expired is self._told:
                return
            self._told = expired
        if self.on_expired is not None:
            self.on_expired(expired)

    # -- keep-alives ------------------------------------------------------------------
    def renew(self) -> None:
        """Send one keep-alive and wait for its answer (any thread)."""
        sent = time.monotonic()
        with self._lock:
            if self._stop.is_set():  # never after a departure ("left") was written
                return
            self._seq += 1
            # The random part: nobody can name this value (``presence.BEAT``) before the
            # store has it, so a watcher that dates it from such a word never dates it
            # earlier than the keep-alive's send, whoever sent the word.
            value = f"{self._seq} {time.time():.3f} {secrets.token_hex(8)}"
            self._last_sent, self._urgent = sent, False
            if self._in_flight is None:
                self._in_flight = sent
            self._sending += 1
        try:
            self.store.heartbeat(self.key, value)
        except BaseException:
            with self._lock:
                self._sent()
                self._in_flight = None
                arming = self._end_arming()
            if arming:  # not renewed: the judge fences once the old lease is over
                JUDGES.wake(self)
            raise
        with self._lock:
            self._sent()
            # Judged as of the answer, before it counts: a lease that ran out (and was
            # not excused) stays run out.
            now = time.monotonic()
            self._judge(now)
            if self._acked_sent is None or sent > self._acked_sent:
                self._acked_sent = sent
            arming = self._end_arming()  # after the answer counted, as ``arm`` waited
            if self._expired is None and self._armed and self._left(now) < 0:
                # Answered after a wait in jeopardy, too late to renew the lease: the next
                # keep-alive goes out at once and carries the wait on.
                self._in_flight, self._urgent = now, True
                self._wake_keeper.set()
            else:
                self._in_flight = None
                self._slow_noted = False
        if arming:  # the round's lease, renewed: judged from now on
            JUDGES.wake(self)
        if self.on_acked is not None:
            self.on_acked(value.encode())

    def _sent(self) -> None:
        """A keep-alive's request ended; caller holds the lock."""
        self._sending -= 1
        self._answered.notify_all()

    def _end_arming(self) -> bool:
        """A keep-alive was answered (or failed): a lease ``arm`` found stale is judged
        from now on. Whether it was; caller holds the lock."""
        arming, self._arming = self._arming, False
        self._armed = self._armed or arming
        return arming

    def _next_due(self) -> float:
        """When the next keep-alive is due: a period after the last one was *sent* (after
        an answer that took long, a paused store, the next goes out at once, while the
        lease it extended is new). Caller holds the lock."""
        if self._urgent or self._last_sent is None:  # a node's first: at once
            return time.monotonic()
        return self._last_sent + self.period

    def _keep(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                due = self._next_due()
                # Until set_quiet(False) or the judge wakes us; a stale lease being armed
                # is renewed even with keep-alives suspended, as ``arm`` always renewed it.
                idle = not (self._beating or self._arming) or self._quiet
                self._keeper_asleep = idle
            self._wake_keeper.wait(None if idle else max(0.0, due - time.monotonic()))
            self._wake_keeper.clear()
            if self._stop.is_set():
                return
            with self._lock:
                due = self._next_due()
            # Woken early (quiet ended right after ``arm`` renewed): nothing is due yet.
            if not (self._beating or self._arming) or self._quiet or time.monotonic() < due:
                continue
            try:
                self.renew()
            except (RendezvousStateError, RendezvousStoreGoneError) as exc:
                if not self._stop.is_set():  # stopped: this node left meanwhile
                    self.error = exc  # the monitor reports it to the agent
                return
            except RendezvousConnectionError as exc:
                log.debug("keep-alive not acknowledged: %s", exc)

    # -- the judge --------------------------------------------------------------------
    def _left(self, now: float) -> float:
        """Seconds of lease left (negative: run out). Caller holds the lock."""
        return (self._acked_sent or -float("inf")) + self.length - now

    def _judge_step(self, now: float) -> float | None:
        """Judge now, and wake the keep-alive thread if it sleeps while one is due; when to
        judge again (monotonic), None: not until ``arm``."""
        with self._lock:
            self._judge(now)
            due, keep_now = self._plan(now)
        if keep_now:
            self._wake_keeper.set()  # it sleeps until woken, and a keep-alive is due
        self._tell()  # at the lease's end: the judge is due then
        return due  # None: nothing to judge until the next round

    def _plan(self, now: float) -> tuple[float | None, bool]:
        """(when to judge next, None: not until ``arm``; whether the sleeping keep-alive
        thread must be woken now, a keep-alive being due). Caller holds the lock."""
        done = not self._armed or self._expired is not None
        due = None if done else now + max(self._left(now), JEOPARDY_POLL)
        keeping = self._keeper_asleep and not self._quiet and self._beating
        keep_due = self._next_due() if keeping and not self._stop.is_set() else None
        if keep_due is not None and keep_due <= now:
            return due, True
        if keep_due is not None:
            due = keep_due if due is None else min(due, keep_due)
        return due, False

    def _judge(self, now: float) -> None:
        """Record the expiry when the lease ran out and is not in jeopardy. Caller holds
        the lock."""
        if not self._armed or self._expired is not None or self._left(now) >= 0:
            return
        silent = now - self._acked_sent if self._acked_sent is not None else float("inf")
        heard = self.store.peer_silence() if self._in_flight is not None else None
        if heard is not None and heard <= HOST_HEARD_WITHIN:
            if not self._slow_noted:
                self._slow_noted = True
                log.warning(
                    "the rendezvous store at %s has not acknowledged a keep-alive for "
                    "%.1fs, but its host acknowledges our packets (%.1fs ago): it is "
                    "overloaded or paused, not unreachable; waiting for it",
                    self.store.where,
                    silent,
                    heard,
                )
            return
        self._expired = Expiry(silent, self._term)
