"""The background thread: heartbeats, liveness, departures, fencing, scale-up, closing.

It has its own store connection (a TCPStore client serialises its operations, so a long
``wait`` in ``next_rendezvous`` would otherwise hold the heartbeat back). Each tick costs a
node two operations whatever N is: its own heartbeat, and one ``multi_get`` of the
``events`` counter with the heartbeats it watches (rank 0 watches every member, every
other member watches rank 0). Only when ``events`` moved does the tick read ``closed``,
the next round's counter, this round's ``lost`` list and the refusals. So a round costs
O(N) operations per interval, never O(N^2). The constant matters as much: one store
server (for c10d, a Python one) answers every node's ticks, so each operation added to a
tick is N more requests a second there; that is why the rarely changing keys are read only
when ``events`` moved (docs/benchmarks.md, "c10d rendezvous at scale", has the numbers).
The agent's frequent ``lost_nodes()`` / ``num_nodes_waiting()`` / ``is_closed()`` calls return
cached values and never block on the network.

Liveness compares heartbeat *values*, not clocks: a member is lost when its value has not
changed for ``heartbeat_timeout`` of our own time and over several of our reads, so neither
clock skew nor this thread being starved on a loaded machine looks like a dead node. A
heartbeat key that vanishes (a lease expired) is lost at once; "left" is a departure.

Fencing: every tick that completes confirms our membership. When the store has left a
tick unanswered for ``heartbeat_timeout`` (it is unreachable: a partition, or its host is
down), or the others published us as lost, ``fenced`` says why and the agent stops its
workers: a node cut off from the job must never keep training in a world that has moved
on. Only an unanswered request counts (``Unanswered``): with hundreds of agents starting
on few cores a tick may run late, and that is not a partition; if it runs so late that
our heartbeat goes stale, the others publish us as lost, which fences us as well. And an
unanswered request fences only while the store's host is silent too
(``CoordinationStore.peer_silence``: TCP acknowledgements, keepalive probes included,
come from its kernel): a store host starved of CPU, or a paused store process, still
acknowledges, is not a partition, and cannot have moved the round on without us.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from elastic.core.interfaces.coordination import HOST_HEARD_WITHIN, CoordinationStore
from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousStoreGoneError,
)
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.presence import PresenceClient, PresenceServer

log = logging.getLogger(__name__)


@dataclass
class _Seen:
    value: bytes
    changed_at: float  # our monotonic clock
    unchanged_reads: int = 0


class LivenessTracker:
    """Which of the watched nodes stopped changing their heartbeat value."""

    def __init__(self, timeout: float, interval: float) -> None:
        self.timeout = timeout
        self.min_reads = max(2, int(timeout / interval) - 1)
        self._seen: dict[str, _Seen] = {}

    def update(self, values: dict[str, bytes], now: float) -> tuple[list[str], list[str]]:
        """Feed fresh values (b"" for a missing key); returns (lost node ids: stale,
        vanished or departed, node ids that finished cleanly)."""
        lost, done = [], []
        for node, value in values.items():
            if value == R.DONE:
                done.append(node)
                continue
            seen = self._seen.get(node)
            if value == R.LEFT or (value == b"" and seen is not None and seen.value != b""):
                lost.append(node)  # departed, or its lease expired: no need to wait
                continue
            if seen is None or seen.value != value:
                self._seen[node] = _Seen(value, now)
                continue
            seen.unchanged_reads += 1
            if now - seen.changed_at >= self.timeout and seen.unchanged_reads >= self.min_reads:
                lost.append(node)
        return lost, done


class Unanswered:
    """The fencing clock: how long the store has left us without an answer, counted from
    the first request it has not answered. A thread that is merely late to ask (on a
    machine starved of CPU) is not a store that does not answer, so it never counts;
    a store that answers slowly but answers keeps the node in. Thread-safe."""

    def __init__(self) -> None:
        self._since: float | None = None

    def asking(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def answered(self) -> None:
        self._since = None

    def seconds(self) -> float:
        since = self._since  # one read: the other thread may clear it meanwhile
        return 0.0 if since is None else time.monotonic() - since


def read_lost(store: CoordinationStore, rnd: int) -> list[str]:
    key = R.lost_key(rnd)
    if rnd < 0 or not store.check([key]):
        return []
    value = R.loads(store.get(key), store.prefix + key)
    if not isinstance(value, list):
        raise RendezvousStateError(f"rendezvous state key {store.prefix + key!r} is not a list")
    return [str(v) for v in value]


def note_event(store: CoordinationStore) -> None:
    """Tell every member's heartbeat thread to re-read the round's keys; call it *after*
    the write it announces, so a tick that sees the new count also sees the write."""
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


class Monitor:
    """``presence``: this agent's presence port (``presence.py``), served when it is rank
    0; ``hello``: what this node says when it connects to rank 0's."""

    def __init__(
        self,
        store: CoordinationStore,
        node_id: str,
        interval: float,
        timeout: float,
        presence: PresenceServer | None = None,
        hello: bytes = b"",
    ) -> None:
        self.store = store
        self.node_id = node_id
        self.interval = interval
        self.timeout = timeout
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # tick now: a presence connection closed
        self._presence = presence
        self._hello = hello
        self._client: PresenceClient | None = None
        self._connect_in: R.Assignment | None = None  # the round whose rank 0 to connect to
        self._gone: set[str] = set()  # rank 0, when our connection to it died
        if presence is not None:
            presence.on_change = self._wake.set
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._beating = True
        self._quiet = False
        # What the agent reads (cached, under _lock).
        self.error: Exception | None = None
        self.closed = False
        self.waiting = 0
        self.lost: list[str] = []
        self._unanswered = Unanswered()
        self._slow_noted = False  # said once per episode that the store is only slow
        # What to watch: the round we are a member of, or a forming round's coordinator.
        self._round: R.Assignment | None = None
        self._rank: int | None = None
        self._tracker = LivenessTracker(timeout, interval)
        self._watch: tuple[int, str] | None = None
        # Abandoning a forming round makes every node join again, so a coordinator gets
        # twice the member timeout before we call it dead.
        self._watch_tracker = LivenessTracker(2 * timeout, interval)
        self._refused_seen = 0
        # The events count the cached round facts (closed, waiting, lost) were read at;
        # None: read them on the next tick.
        self._events_seen: int | None = None
        self._published: list[str] = []

    # -- control (agent thread) ----------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self.beat()  # exists before we join, so a coordinator can read it at once
        self._thread = threading.Thread(
            target=self._run, name=f"rdzv-heartbeat-{self.node_id}", daemon=True
        )
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stop(self, wait: bool = True) -> None:
        """Stop the thread; ``wait=False`` when it may be stuck in a store call (a
        partition) and the caller must not be held up by it."""
        self._stop.set()
        self._wake.set()
        self._stop_client()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5)

    def suspend_heartbeats(self) -> None:
        """Stop beating but keep watching (how tests simulate a hung node)."""
        self._beating = False

    def set_round(self, asg: R.Assignment | None, rank: int | None) -> None:
        with self._lock:
            self._round, self._rank = asg, rank
            self._tracker = LivenessTracker(self.timeout, self.interval)
            self.waiting, self.lost = 0, []
            self._events_seen, self._published = None, []
            self._gone = set()
            # A member connects to rank 0's presence port on its first tick in the round,
            # not here: a round's forming is not held up by N connections made at once.
            self._connect_in = asg if rank and asg is not None and asg.presence_port else None
        self._stop_client()
        if rank == 0 and asg is not None and self._presence is not None:
            self._presence.watch(m for m in asg.members if m != self.node_id)

    def _connect_presence(self) -> None:
        with self._lock:
            asg, self._connect_in = self._connect_in, None
        if asg is None:
            return
        rank0 = asg.members[0]
        client = PresenceClient(
            asg.master_addr, asg.presence_port, self._hello, lambda: self._died(asg, rank0)
        )
        with self._lock:
            if asg is self._round and self._client is None:
                self._client = client
                return
        client.stop()  # the round changed meanwhile

    def _stop_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.stop()

    def _died(self, asg: R.Assignment, node: str) -> None:
        """Our connection to ``node`` (rank 0) closed and its port refuses us."""
        with self._lock:
            if asg is not self._round:
                return
            self._gone.add(node)
        self._wake.set()

    def set_phase(self, watch: tuple[int, str] | None, quiet: bool) -> None:
        """While a round forms: whose heartbeat to watch (a forming round's coordinator),
        and whether we may stay quiet (only the coordinator's liveness matters then)."""
        with self._lock:
            self._watch, self._quiet = watch, quiet
            self._watch_tracker = LivenessTracker(2 * self.timeout, self.interval)

    @property
    def in_round(self) -> bool:
        return self._round is not None

    def fenced(self, where: str) -> str | None:
        """Why this node can no longer count itself a member of its round, or None."""
        with self._lock:
            asg, lost = self._round, self.lost
        if asg is None:
            return None
        if self.node_id in lost:
            return (
                f"the job declared this node lost in round {asg.round} (its heartbeat was "
                "not seen in time); stopping its workers and rejoining"
            )
        silent = self._unanswered.seconds()
        if silent > self.timeout and self._cut_off(silent, where):
            return (
                f"cannot reach the rendezvous store at {where} for {silent:.1f}s "
                f"(heartbeat_timeout={self.timeout:g}s): stopping this node's workers so it "
                "never trains in a world that has moved on; it rejoins when the store answers"
            )
        return None

    def _cut_off(self, silent: float, where: str) -> bool:
        """The store has not answered for ``silent`` s: are we cut off from it? Not while
        its host still acknowledges our packets: then the store is slow (its host
        overloaded, its process paused) and no one can move the round on without it, so
        our workers keep a world that is still the job's."""
        quiet = self.store.peer_silence()
        # A reachable host may be this quiet between two keepalive answers, whatever the
        # timeout: with heartbeat_timeout=1 s a probe due at 1 s lands just after it.
        if quiet is None or quiet > max(self.timeout, HOST_HEARD_WITHIN):
            return True
        if not self._slow_noted:
            self._slow_noted = True
            log.warning(
                "the rendezvous store at %s has not answered for %.1fs, but its host "
                "acknowledges our packets (%.1fs ago): it is overloaded or paused, not "
                "unreachable; waiting for it",
                where,
                silent,
                quiet,
            )
        return False

    # -- the thread ----------------------------------------------------------------
    def beat(self) -> None:
        if self._beating:
            self._seq += 1
            self.store.heartbeat(R.hb_key(self.node_id), f"{self._seq} {time.time():.3f}")

    def _run(self) -> None:
        next_tick = time.monotonic() + self.interval
        while True:
            presence = self._presence if self._rank == 0 else None
            due = presence.next_due(self._published) if presence is not None else None
            wake_at = next_tick if due is None else min(next_tick, due)
            self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            if time.monotonic() >= next_tick:
                # After a stall, carry on from now rather than bursting to catch up.
                next_tick = max(next_tick + self.interval, time.monotonic())
            self._unanswered.asking()
            try:
                self._tick()
                self._unanswered.answered()
                self._slow_noted = False
            except (RendezvousStateError, RendezvousStoreGoneError) as exc:
                # Final: corrupt state, or the store's host says the store is gone.
                with self._lock:
                    self.error = exc
                # The agent reads ``error`` within a tick and says it in one line of its
                # own; logging it here too would say it twice.
                log.debug("rendezvous heartbeat stopped: %s", exc)
                return
            except RendezvousConnectionError as exc:
                # Unreachable: keep trying (a partition may heal); ``fenced`` tells the
                # agent once it has lasted heartbeat_timeout.
                log.debug("rendezvous heartbeat: store unreachable: %s", exc)
            except Exception as exc:  # a bug must surface to the agent, not kill silently
                log.exception("rendezvous heartbeat failed")
                with self._lock:
                    self.error = RendezvousConnectionError(f"heartbeat thread failed: {exc}")
                return

    def _tick(self) -> None:
        self._connect_presence()
        with self._lock:
            asg, rank, watch, quiet = self._round, self._rank, self._watch, self._quiet
        if not quiet:
            self.beat()
        if watch is not None:
            self._check_coordinator(*watch)
        if asg is None or rank is None:
            return  # between rounds the protocol itself sees closing and new rounds
        # Rank 0 watches everyone; everyone watches rank 0. A departing node publishes
        # itself, so everyone learns of a departure from the lost key within one tick.
        targets = [m for m in asg.members if m != self.node_id] if rank == 0 else asg.members[:1]
        raw_events, *beats = self.store.multi_get([R.EVENTS] + [R.hb_key(m) for m in targets])
        if not raw_events:
            self.store.add(R.EVENTS, 0)  # create it, so the next reads find every key
        events = R.counter(raw_events, self.store.prefix + R.EVENTS)
        with self._lock:
            closed, waiting, seen = self.closed, self.waiting, self._events_seen
        if events != seen:
            closed = self.store.check([R.CLOSED])
            nxt = R.count_key(asg.round + 1)
            waiting = self.store.add(nxt, 0) if self.store.check([nxt]) else 0
            self._published = read_lost(self.store, asg.round)
            self._log_refused()
        lost = self._check_members(asg, dict(zip(targets, beats, strict=True)))
        with self._lock:
            if asg is self._round:  # not replaced by a new round meanwhile
                self.closed, self.waiting, self.lost = closed, waiting, lost
                self._events_seen = events

    def _log_refused(self) -> None:
        """One line per node the job turned away (its fingerprint differed)."""
        if not self.store.check([R.REFUSED_COUNT]):
            return
        count = self.store.add(R.REFUSED_COUNT, 0)
        for index in range(self._refused_seen + 1, count + 1):
            key = R.refused_key(index)
            if not self.store.check([key]):
                return  # counted but not written yet: read it next tick
            note = R.loads(self.store.get(key), self.store.prefix + key)
            if isinstance(note, dict):
                log.warning(
                    "refused node %s (pid %s): its %s differ from the job's",
                    note.get("host"),
                    note.get("pid"),
                    ", ".join(note.get("fields", [])),
                )
            self._refused_seen = index

    def _check_members(self, asg: R.Assignment, beats: dict[str, bytes]) -> list[str]:
        stale, _ = self._tracker.update(beats, time.monotonic())
        with self._lock:
            dead = set(self._gone)  # a member: rank 0's process died
        if self._presence is not None and self._rank == 0:
            dead.update(self._presence.gone())  # rank 0: these members' processes died
        new = sorted((set(stale) | dead) - set(self._published))
        if new:
            log.warning("round %d: lost %s", asg.round, ", ".join(new))
            # Publishing wakes every survivor (their next tick sees the events counter).
            self._published = add_lost(self.store, asg.round, new)
        return self._published

    def _check_coordinator(self, rnd: int, coordinator: str) -> None:
        beats = {coordinator: self.store.multi_get([R.hb_key(coordinator)])[0]}
        stale, done = self._watch_tracker.update(beats, time.monotonic())
        if stale or done:
            log.warning("round %d: coordinator %s stopped; abandoning the round", rnd, coordinator)
            # The same compare_set a coordinator publishes with: exactly one outcome wins,
            # and it wakes everyone waiting for this round.
            abandoned = R.Assignment(round=rnd, state="abandoned").to_json(None, "")
            self.store.compare_set(R.assignment_key(rnd), "", abandoned)
            with self._lock:
                self._watch = None
