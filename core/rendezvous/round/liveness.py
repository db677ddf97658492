"""Who of a round is dead: heartbeat values, presence connections, the lost list.

Liveness compares heartbeat *values*, not clocks: a member is lost when a read sent
``heartbeat_timeout`` after we first received its current value, and at least
``min_reads`` reads after that first one, still find that value. So neither clock skew
nor a starved monitor thread on a loaded machine looks like a dead node, and a verdict
never comes before the judged node's lease ran out (``lease.py`` has the argument). A
heartbeat key that vanished (an etcd lease or TTL ran out) reads as an unchanged value:
the same rule judges it. "left" is a departure, lost at once.

A process that dies is seen sooner, by its presence connections (``presence.py``): the
round's serving ranks (``SERVING_RANKS``: rank 0 and its deputy, rank 1) listen, every
member holds a connection to rank 0 and, once rank 0 is gone, to the deputy
(``links.py``), through a regroup too. So when rank 0 leaves (a preemption), a member
that dies while the others re-form is still found by a closed connection. Every verdict
goes to the round's lost list (``add_lost``: merged with compare_set, ``note_event``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.rendezvous import RendezvousStateError
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.links import PresenceLinks
from elastic.core.rendezvous.round.presence import CONNECT_WAIT, PresenceServer
from elastic.core.rendezvous.round.presence_client import PresenceClient
from elastic.core.rendezvous.round.probe import refusing
from elastic.core.rendezvous.round.signing import read_values

log = logging.getLogger(__name__)

# The ranks whose presence port is used: rank 0 and its deputy, rank 1.
SERVING_RANKS = (0, 1)
# s rank 0 waits for the ports of members that never connected to answer: a live agent's
# accepts at once, a dead one's host refuses at once; silence leaves it to the heartbeats.
PROBE_WAIT = 0.5
# Ports asked at once at most (a descriptor each); the rest on the ticks that follow.
PROBE_BATCH = 64


@dataclass
class _Seen:
    value: bytes
    changed_at: float  # our monotonic clock
    unchanged_reads: int = 0


class LivenessTracker:
    """Which of the watched nodes stopped changing their heartbeat value."""

    def __init__(self, timeout: float, interval: float) -> None:
        self.timeout = timeout
        # At least three: a store paused while a keep-alive waits in it answers a peer at
        # most once more with the old value (``lease.py``).
        self.min_reads = max(3, int(timeout / interval) - 1)
        self._seen: dict[str, _Seen] = {}
        self._last_asked = float("-inf")

    def update(
        self,
        values: dict[str, bytes],
        asked: float,
        answered: float | None = None,
        hints: dict[str, tuple[bytes, float]] | None = None,
    ) -> tuple[list[str], list[str]]:
        """Feed the values of a read sent at ``asked`` and answered at ``answered`` (our
        monotonic clock; b"" for a missing key); returns (lost node ids: stale or
        departed, node ids that finished cleanly). A value's clock starts when it was
        first *received*, and a verdict needs a read *sent* ``timeout`` later: a slow
        answer never shortens the time a node is given. ``hints``: node -> (a value it
        said was acknowledged, when we heard that: ``presence.BEAT``), an earlier first
        receipt of that value than this read's answer when it is the value read."""
        answered = asked if answered is None else answered
        self._last_asked = max(self._last_asked, asked)
        lost, done = [], []
        for node, value in values.items():
            if value == R.DONE:
                done.append(node)
                continue
            if value == R.LEFT:
                lost.append(node)  # departed: no need to wait
                continue
            seen = self._seen.get(node)
            if seen is not None and value == b"":
                value = seen.value  # vanished (an etcd lease ran out): judged as unchanged
            if seen is None or seen.value != value:
                hint = (hints or {}).get(node)
                heard = hint[1] if hint is not None and hint[0] == value else answered
                self._seen[node] = _Seen(value, min(answered, heard))
                continue
            seen.unchanged_reads += 1
            if asked - seen.changed_at >= self.timeout and seen.unchanged_reads >= self.min_reads:
                lost.append(node)
        return lost, done

    def due(self) -> float | None:
        """When a read would decide that a watched value is stale: ``timeout`` after it
        was first received, once the reads before it make ``min_reads``. Read then, not on
        the next tick: on a fixed grid the verdict's read comes up to an interval late
        (the first receipt is a read's *answer*, the verdict needs a read *sent* a full
        ``timeout`` later, and the grid's read that far on is sent a moment too soon about
        half the time). One such read per value: ``min_reads`` counts reads an interval
        apart, and a value read once past its due and still not decided (too few reads)
        is left to the ticks."""
        due = [
            s.changed_at + self.timeout
            for s in self._seen.values()
            if s.unchanged_reads + 1 >= self.min_reads
            and s.changed_at + self.timeout > self._last_asked
        ]
        return min(due) if due else None


def read_lost(store: CoordinationStore, rnd: int) -> list[str]:
    key = R.lost_key(rnd)
    if rnd < 0 or not store.check([key]):
        return []
    return parse_lost(store.get(key), store.prefix + key)


def parse_lost(raw: bytes | None, key: str) -> list[str]:
    """A round's lost list as read from ``key`` (full name); absent or foreign: []."""
    if not raw:
        return []
    value = R.loads(raw, key)
    if not isinstance(value, list):
        raise RendezvousStateError(f"rendezvous state key {key!r} is not a list")
    return [str(v) for v in value]


def note_event(store: CoordinationStore) -> None:
    """Tell every member's heartbeat thread to re-read the round's keys; call it *after*
    the write it announces, so a tick that sees the new count also sees the write.

    ``events`` is a hint anyone reaching the store can write (it cannot be signed: the
    store adds to it): readers take a value that is no counter as "something changed",
    and with a token ``SignedStore.add`` replaces it rather than fail to add to it."""
    store.add(R.EVENTS, 1)


def add_lost(store: CoordinationStore, rnd: int, nodes: list[str]) -> list[str]:
    """Merge ``nodes`` into round ``rnd``'s lost list with compare_set, so two nodes
    publishing at once never erase each other's entries; returns the merged list."""
    key = R.lost_key(rnd)
    for _ in range(20):
        raw = store.get(key) if store.check([key]) else b""
        current = R.loads(raw, store.prefix + key) if raw else []
        merged = sorted(set(current if isinstance(current, list) else []) | set(nodes))
        if merged == sorted(current) and raw:
            return merged
        desired = R.dumps(merged).encode()
        if bytes(store.compare_set(key, raw, desired)) == desired:
            note_event(store)
            return merged
    raise RendezvousStateError(f"could not update {store.prefix + key!r}: too much contention")


class Liveness:
    """Who of this node's round died, and publishing it: the heartbeats it watches, its
    presence connections (``links``) and, when it serves, its members' connections to
    it (``presence``); the round's lost list as last published or read. The round comes
    from the monitor (``follow``, under the monitor's lock); the checks run on its
    thread. ``store``: the round's keys; ``wake``: tick now (a death was seen)."""

    def __init__(
        self,
        store: CoordinationStore,
        node_id: str,
        interval: float,
        timeout: float,
        presence: PresenceServer | None,
        hello: Callable[[int, str], bytes] | None,
        wake: Callable[[], None],
    ) -> None:
        self.store = store
        self.node_id = node_id
        self.interval, self.timeout = interval, timeout
        self.presence = presence
        self.links = PresenceLinks(hello, wake)
        self._lock = threading.Lock()
        self._tracker = LivenessTracker(timeout, interval)
        # Abandoning a forming round makes every node join again, so a coordinator gets
        # twice the member timeout before we call it dead.
        self._watch_tracker = LivenessTracker(2 * timeout, interval)
        self._published: list[str] = []
        # The last round and our rank in it while the job re-forms (``follow``).
        self.between: R.Assignment | None = None
        self.between_rank: int | None = None
        # Rank 0: where the round's members' presence ports listen, and those already
        # asked whether theirs still does (``_ask_silent``).
        self._addresses: dict[str, str] = {}
        self._asked: set[str] = set()

    def follow(
        self,
        last: R.Assignment | None,
        last_rank: int | None,
        asg: R.Assignment | None,
        rank: int | None,
        others: list[str],
        addresses: dict[str, str] | None = None,
    ) -> tuple[list[PresenceClient], bool]:
        """The round changes from ``last`` (our rank ``last_rank``) to ``asg`` (``rank``;
        None: none runs); ``others``: its members but us, when we serve it, and
        ``addresses``: where their presence ports listen ("addr:port"). Returns the
        old round's connections, for the caller to stop out of its lock, and whether
        deaths were carried over (tick now)."""
        with self._lock:
            # A serving rank of the last round whose deaths while the job re-formed count.
            listened = self.between_rank in SERVING_RANKS
            # A regroup (no round runs): the last round's presence holds until the next
            # forms, its connections kept and its deaths published (``check_between``),
            # so a member that dies while the others re-form is found by its closed
            # connection, not by heartbeat_timeout in the coordinator's last call.
            regroup = asg is None and last is not None
            if regroup:
                self.between, self.between_rank = last, last_rank
            elif asg is not None:
                self.between, self.between_rank = None, None
            self._tracker = LivenessTracker(self.timeout, self.interval)
            if not regroup:
                self._published = []
                self.links.forget()
            keep = asg is None and self.between is not None
            self._addresses = dict(addresses or {}) if rank == 0 and asg is not None else {}
            self._asked = set()
        # A member connects to rank 0's presence port from the monitor thread, woken for
        # it now (not on the round's first tick, an interval later: a member killed in
        # its round's first second would be seen only after heartbeat_timeout); the
        # round's forming is not held up by the connection.
        # The old round's connections go in the same step: a tick that runs from here
        # on makes the new round's, which nothing may stop. A regroup keeps them.
        old = self.links.follow(asg, rank, keep)
        if rank not in SERVING_RANKS or asg is None or self.presence is None:
            return old, False
        # A member of the new round whose connection to us (a serving rank of the last
        # round too) closed unasked while the job re-formed died after it joined: the
        # new round starts with it lost, not with a wait for its heartbeat.
        died = [n for n in self.presence.gone(grace=0.0) if n in others and listened]
        self.presence.watch(others, asg.round)
        self.links.add_gone(asg, died)
        return old, bool(died)

    def reset_watch(self) -> None:
        """A new forming round's coordinator to watch: its clock starts again."""
        with self._lock:
            self._watch_tracker = LivenessTracker(2 * self.timeout, self.interval)

    def published(self) -> list[str]:
        """The round's lost list as last read or written."""
        with self._lock:
            return list(self._published)

    def set_published(self, lost: list[str]) -> None:
        """The round's lost list as just read."""
        with self._lock:
            self._published = lost

    def next_due(self, rank: int | None) -> float | None:
        """When the monitor must tick before its next interval: a watched heartbeat's
        verdict read (``LivenessTracker.due``) and, if we serve (with ``rank`` in the
        running round, or in the last one), the earliest closed connection to us not yet
        published becoming a death, or silent members due to be asked."""
        with self._lock:
            serving = (self.between_rank if rank is None else rank) in SERVING_RANKS
            published = list(self._published)
            tracker = self._tracker if rank is not None else None
        dues = [tracker.due() if tracker is not None else None]
        if serving and self.presence is not None:
            dues += [self.presence.next_due(published), self._silent_due()]
        known = [d for d in dues if d is not None]
        return min(known) if known else None

    def _silent(self) -> tuple[list[str], float]:
        """Rank 0: the members not yet asked that never connected, and when they are due
        to be asked (``CONNECT_WAIT`` after the round was watched)."""
        if self.presence is None:
            return [], 0.0
        with self._lock:
            addresses, asked = self._addresses, self._asked
        if not addresses:
            return [], 0.0
        quiet, since = self.presence.silent()
        left = [n for n in quiet if n not in asked and addresses.get(n)]
        if not left:
            # Every member connected or was asked: none becomes silent again this round,
            # so the monitor's wakes stop scanning the round's members for it.
            with self._lock:
                if self._addresses is addresses:
                    self._addresses = {}
        return left, since + CONNECT_WAIT

    def _silent_due(self) -> float | None:
        quiet, due = self._silent()
        return due if quiet else None

    def _ask_silent(self) -> set[str]:
        """Rank 0: the members that never connected whose port refuses (their process is
        gone: killed after they joined, before they learnt the round formed). Each is asked
        once per round; one that answers is left to its heartbeat."""
        quiet, due = self._silent()
        if not quiet or time.monotonic() < due:
            return set()
        quiet = quiet[:PROBE_BATCH]
        with self._lock:
            addresses = self._addresses
            self._asked.update(quiet)
        refused = refusing([addresses[n] for n in quiet], PROBE_WAIT)
        return {n for n in quiet if addresses[n] in refused}

    def members(
        self,
        asg: R.Assignment,
        rank: int,
        beats: dict[str, bytes],
        asked: float,
        answered: float,
    ) -> list[str]:
        """Round ``asg``'s lost list, with whoever was found dead since published in it:
        stale ``beats`` (read at ``asked``, answered at ``answered``), a serving rank our
        connection found dead, and, when we serve, members whose connection closed."""
        # When watched values were first known, by the ``beat`` words (``presence.py``).
        if rank == 0:
            hints = self.presence.beat_hints() if self.presence is not None else None
        else:
            beat = self.links.rank0_beat()
            hints = {asg.first: beat} if beat is not None and asg.first is not None else None
        stale, _ = self._tracker.update(beats, asked, answered, hints)
        dead = self.links.gone()  # a serving rank's process died
        if self.presence is not None and rank in SERVING_RANKS:
            dead.update(self.presence.gone())  # these members' processes died
            dead.update(self._ask_silent())  # and these, before they connected
        with self._lock:
            published = self._published
        new = sorted((set(stale) | dead) - set(published))
        if new:
            log.warning("round %d: lost %s", asg.round, ", ".join(new))
            # Publishing wakes every survivor (their next tick sees the events counter).
            published = add_lost(self.store, asg.round, new)
            with self._lock:
                self._published = published
        return published

    def check_between(self) -> None:
        """While the job re-forms: publish the last round's members whose process died
        (a serving rank's closed connections, or ours to one refused) in its lost list;
        the coordinator re-reads it when ``events`` moves and stops waiting for them.
        Rank 0's deputy still listens when rank 0 itself left."""
        dead = self.links.gone()
        with self._lock:
            prev, prev_rank, published = self.between, self.between_rank, list(self._published)
        if prev is None:
            return
        if prev_rank in SERVING_RANKS and self.presence is not None:
            dead.update(self.presence.gone())
        new = sorted(dead - set(published) - {self.node_id})
        if new:
            log.warning("round %d: lost %s while the job re-forms", prev.round, ", ".join(new))
            merged = add_lost(self.store, prev.round, new)
            with self._lock:
                if self.between is prev:
                    self._published = merged

    def coordinator_stopped(self, coordinator: str) -> bool:
        """Whether a forming round's coordinator stopped: its heartbeat (twice the member
        timeout), or, at once, its process death published in the last round's lost list
        while the job re-forms (``check_between``: a serving rank saw its presence
        connection close). One read."""
        with self._lock:
            prev, tracker = self.between, self._watch_tracker
        keys = [R.hb_key(coordinator)] + ([R.lost_key(prev.round)] if prev is not None else [])
        asked = time.monotonic()
        values = read_values(self.store, keys)
        beat = values[0]
        beats = {} if beat is None else {coordinator: beat}
        stale, done = tracker.update(beats, asked, time.monotonic())
        lost = parse_lost(values[1], self.store.prefix + keys[1]) if prev is not None else []
        return bool(stale or done or coordinator in lost)
