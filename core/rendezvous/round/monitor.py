"""The background thread: departures, scale-up, closing, the job's keys; and the node's
lease. Who is dead it asks ``liveness.py`` (heartbeat values, presence connections).

Keep-alives and fencing are the lease's (``lease.py``: a store connection and a thread of
their own, so nothing here delays them). This thread has a connection of its own too (a
TCPStore client serialises its operations, so a long ``wait`` in ``next_rendezvous`` would
otherwise hold it back). A tick is one store operation whatever N is: one ``multi_get`` of
the ``events`` counter, the heartbeats this node watches (rank 0 watches every member,
every other member watches rank 0) and the job-wide keys the agent asked for
(``watch_job``: the failed flag, the round's restart claim and preemption notice). Only
when ``events`` moved does the tick read ``closed``, the next round's counter, this
round's ``lost`` list and the refusals. So an idle member costs the store two requests
per heartbeat interval, this tick and the lease's keep-alive (on c10d a MULTI_GET and a
COMPARE_SET), and a round O(N) operations per interval, never O(N^2). The constant
matters as much: one store server (for c10d, a Python one) answers every node's ticks,
so each operation added to a tick is N more requests a second there; that is why the
rarely changing keys are read only when ``events`` moved (docs/architecture.md has the
counts). The agent's frequent ``lost_nodes()`` / ``num_nodes_waiting()`` /
``is_closed()`` calls return cached values and never block on the network.

Fencing (``fenced``): the others published us as lost, or our lease ran out; the agent
then stops its workers, so a node cut off from the job never trains in a world that has
moved on. It is told the moment either happens (``on_fenced``: from the lease's judge, or
from the tick that read the lost list), not when its loop next asks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.rendezvous import (
    RendezvousAuthError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousStoreGoneError,
)
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.lease import Expiry, Lease
from elastic.core.rendezvous.round.liveness import SERVING_RANKS, Liveness, parse_lost
from elastic.core.rendezvous.round.presence import PresenceServer
from elastic.core.rendezvous.round.signing import parse_counter, read_values

log = logging.getLogger(__name__)

RDZV = "rdzv/"  # the round's keys, under the job's view


class Monitor:
    """``store``: the job's view (the round's keys are under ``rdzv/``), on a connection
    of this thread's own; ``lease_store``: another of the same view for the keep-alives
    (None: ``store``, for tests); ``presence``: this agent's presence port
    (``presence.py``), served when it is rank 0 or 1 (``SERVING_RANKS``); ``hello``: what
    this node answers a serving rank's challenge with, given the round and the challenge
    (``presence.hello_line``)."""

    def __init__(
        self,
        store: CoordinationStore,
        node_id: str,
        interval: float,
        timeout: float,
        presence: PresenceServer | None = None,
        hello: Callable[[int, str], bytes] | None = None,
        lease_store: CoordinationStore | None = None,
    ) -> None:
        self.job_store = store
        self.store = store.sub(RDZV)
        self.node_id = node_id
        self.interval = interval
        self.timeout = timeout
        self.lease = Lease((lease_store or store).sub(RDZV), R.hb_key(node_id), interval, timeout)
        self.lease.on_expired = self._lease_ran_out
        # ``on_fenced(round, grace)``: stop the workers of ``round`` now, SIGKILL after
        # ``grace`` s (the agent's fence guard; called on this thread or the judge's).
        self.on_fenced: Callable[[int, float], None] | None = None
        self._told_lost: int | None = None  # the round we were published lost in, told
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # look now: a tick is wanted, or a connection
        self._tick_now = False  # a presence connection closed: tick at once
        self.liveness = Liveness(
            self.store, node_id, interval, timeout, presence, hello, self._want_tick
        )
        self.lease.on_acked = self._say_beat
        if presence is not None:
            presence.on_change = self._want_tick
            presence.on_left = self._someone_left
        self._thread: threading.Thread | None = None
        self._next_tick = 0.0  # monotonic; set by ``start`` and by each new round
        # What the agent reads (cached, under _lock).
        self._error: Exception | None = None
        self.closed = False
        self.closed_here = False  # this node closed the job (``closed`` is the store's word)
        self.waiting = 0
        self.lost: list[str] = []
        # Job-wide keys read on every tick for the agent (``watch_job``), and their values.
        self._job_keys: list[str] = []
        self._job_values: list[bytes] | None = None
        # What to watch: the round we are a member of, or a forming round's coordinator.
        self._round: R.Assignment | None = None
        self._rank: int | None = None
        self._others: list[str] = []  # rank 0: the round's other members, whom it watches
        self._watch: tuple[int, str] | None = None
        self._refused_seen = 0
        # The events count the cached round facts (closed, waiting, lost) were read at;
        # None: read them on the next tick.
        self._events_seen: int | None = None

    @property
    def error(self) -> Exception | None:
        """Final: the store is gone or its state corrupt (this thread's or the lease's)."""
        return self._error or self.lease.error

    # -- control (agent thread) ----------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self.lease.start(self.node_id)
        self._next_tick = time.monotonic() + self.interval
        self._thread = threading.Thread(
            target=self._run, name=f"rdzv-monitor-{self.node_id}", daemon=True
        )
        self._thread.start()

    def stop(self, wait: bool = True, keep_links: bool = False) -> None:
        """Stop the threads; ``wait=False`` when one may be stuck in a store call (a
        partition) and the caller must not be held up by it. ``keep_links``: the presence
        connections stay until ``say_left`` (a departure, once it is published)."""
        self._stop.set()
        self._wake.set()
        self.lease.stop()
        if not keep_links:
            self.liveness.links.stop()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5)

    def say_left(self) -> None:
        """Close the presence connections with ``left``: this node published its
        departure, and the serving rank reads it now and tells the others."""
        self.liveness.links.stop(leaving=True)

    def suspend_heartbeats(self) -> None:
        """Stop the keep-alives but keep watching (how tests simulate a hung node)."""
        self.lease.suspend()

    def watch_job(self, keys: list[str]) -> None:
        """Read these job-wide keys on every tick (``job_values``); [] for none."""
        with self._lock:
            self._job_keys, self._job_values = list(keys), None

    def job_values(self) -> list[bytes] | None:
        """The ``watch_job`` keys' values as of the last tick; None before one."""
        with self._lock:
            return self._job_values

    def set_round(
        self,
        asg: R.Assignment | None,
        rank: int | None,
        outcome_sent: float | None = None,
        members: Sequence[str] = (),
        addresses: Sequence[str] = (),
    ) -> None:
        """The round this node is a member of (None: none runs); ``outcome_sent``: when
        the request that brought its outcome was sent (``Lease.arm``); ``members``: the
        round's, by rank: rank 0 watches their heartbeats (the others watch only rank 0's),
        ranks 0 and 1 their presence connections; ``addresses``: where each member's
        presence port listens ("addr:port", "" for none), for rank 0 to ask."""
        others = [m for m in members if m != self.node_id] if rank in SERVING_RANKS else []
        ports = dict(zip(members, addresses, strict=False))
        with self._lock:
            old, carried = self.liveness.follow(self._round, self._rank, asg, rank, others, ports)
            self._round, self._rank, self._others = asg, rank, others
            self.waiting, self.lost = 0, []
            self._events_seen = None
            if asg is not None:
                # The round's first tick comes an interval after it formed, not at once:
                # its outcome is fresh, and a thousand members returning together do not
                # read it again while the last are still returning.
                self._next_tick = time.monotonic() + self.interval
        # Connect to rank 0 now, from this thread (it never blocks: the process's presence
        # thread connects), rather than waking the monitor's: a thousand members of one
        # process returning together would wake a thousand threads for it.
        self.liveness.links.connect(deputy=not self.closed)
        for client in old:
            client.stop()
        self.lease.arm(asg is not None, outcome_sent, asg.round if asg is not None else -1)
        if carried:
            self._want_tick()

    def _want_tick(self) -> None:
        with self._lock:
            self._tick_now = True
        self._wake.set()

    def _say_beat(self, value: bytes) -> None:
        """Our keep-alive writing ``value`` was acknowledged (the keep-alive's thread):
        as rank 0, tell every member, each of which watches our heartbeat; as a member,
        tell rank 0, which watches ours (``presence.BEAT``)."""
        with self._lock:
            rank = self._rank
        if rank == 0 and self.liveness.presence is not None:
            self.liveness.presence.tell_beat(value)
        elif rank is not None:
            self.liveness.links.say_beat(value)

    def _someone_left(self) -> None:
        """A member connected to us said it left (its departure is written): read it now,
        unless the round already lost someone (it re-forms anyway; a thousand nodes
        scaled in at once must not make a thousand ticks of a thousand keys)."""
        with self._lock:
            known = bool(self.lost)
        if not known:
            self._want_tick()

    def set_phase(self, watch: tuple[int, str] | None, quiet: bool) -> None:
        """While a round forms: whose heartbeat to watch (a forming round's coordinator),
        and whether we may stay quiet (only the coordinator's liveness matters then)."""
        with self._lock:
            self._watch = watch
            self.liveness.reset_watch()
        self.lease.set_quiet(quiet)

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
        expired = self.lease.expired()
        if expired is not None:
            return (
                f"cannot reach the rendezvous store at {where}: no keep-alive acknowledged "
                f"for {expired.silent:.1f}s (lease {self.lease.length:g}s, "
                f"heartbeat_timeout={self.timeout:g}s): stopping this node's workers before "
                "the others may count it lost; it rejoins when the store answers"
            )
        return None

    def _lease_ran_out(self, expiry: Expiry) -> None:
        with self._lock:
            asg = self._round
        if asg is not None and asg.round == expiry.term:
            self._tell_fenced(asg.round)

    def _tell_fenced(self, rnd: int) -> None:
        action = self.on_fenced
        if action is not None:
            action(rnd, self.lease.kill_grace)

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            due = self.liveness.next_due(self._rank)
            with self._lock:
                next_tick = self._next_tick
            wake_at = next_tick if due is None else min(next_tick, due)
            self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            # The deputy's, once rank 0 said goodbye (``links`` woke us); a closed job's: none.
            self.liveness.links.connect(deputy=not self.closed)
            now = time.monotonic()
            with self._lock:
                woken, self._tick_now = self._tick_now, False
                if not woken and now < self._next_tick and (due is None or now < due):
                    continue  # a new round moved the ticks, or only connected
                if now >= self._next_tick:
                    # After a stall, carry on from now rather than bursting to catch up.
                    self._next_tick = max(self._next_tick + self.interval, now)
            try:
                self._tick()
            except (RendezvousStateError, RendezvousStoreGoneError, RendezvousAuthError) as exc:
                # Final: corrupt state, the store's host says the store is gone, or the
                # job's records are signed with a token this node lacks.
                with self._lock:
                    self._error = exc
                # The agent reads ``error`` within a tick and says it in one line of its
                # own; logging it here too would say it twice.
                log.debug("rendezvous monitor stopped: %s", exc)
                return
            except RendezvousConnectionError as exc:
                # Unreachable: keep trying (a partition may heal); the lease fences.
                log.debug("rendezvous monitor: store unreachable: %s", exc)
            except Exception as exc:  # a bug must surface to the agent, not kill silently
                log.exception("rendezvous monitor failed")
                with self._lock:
                    self._error = RendezvousConnectionError(f"monitor thread failed: {exc}")
                return

    def _tick(self) -> None:
        self.liveness.links.connect(deputy=not self.closed)
        with self._lock:
            asg, rank, watch, job_keys = self._round, self._rank, self._watch, self._job_keys
            others = self._others
        if watch is not None:
            self._check_coordinator(*watch)
        if asg is None or rank is None:
            # Between rounds the protocol itself sees closing and new rounds.
            self.liveness.check_between()
            return
        # Rank 0 watches everyone; everyone watches rank 0. A departing node publishes
        # itself, so everyone learns of a departure from the lost key within one tick.
        targets = others if rank == 0 else [asg.first]
        with self._lock:
            closed, waiting, seen = self.closed, self.waiting, self._events_seen
        # The round's facts are read again when the events count moved; on a round's
        # first tick they are read along, so a round starts with one request per node.
        facts = [R.CLOSED, R.count_key(asg.round + 1), R.lost_key(asg.round), R.REFUSED_COUNT]
        eager = facts if seen is None else []
        hb_keys = [R.hb_key(m) for m in targets]
        keys = [RDZV + k for k in (R.EVENTS, *hb_keys, *eager)] + job_keys
        asked = time.monotonic()
        # read_values: a value not signed with the job token is None (signing.py).
        values = read_values(self.job_store, keys)
        answered = time.monotonic()
        raw_events, beats = values[0], values[1 : 1 + len(targets)]
        after_beats = 1 + len(targets) + len(eager)
        if not raw_events:
            self.store.compare_set(R.EVENTS, "", "0")  # create it: later reads find every key
        # Only a hint: a value that is no counter (anyone may write one) means "re-read".
        events = parse_counter(raw_events or b"")
        if events is None or events != seen:
            read = values[1 + len(targets) : after_beats] if eager else None
            closed, waiting = self._read_facts(facts, read)
        # A foreign heartbeat value (None) is no news: never "left", never "vanished".
        beat_of = {m: b for m, b in zip(targets, beats, strict=True) if b is not None}
        if closed or self.closed_here:
            # A closed job forms no round again, and every member's workers are done (it
            # closes after the exit barrier, or when it failed): a member that stops
            # beating now is ending, not lost, and its "done" may come a moment later.
            lost = self.liveness.published()
        else:
            lost = self.liveness.members(asg, rank, beat_of, asked, answered)
        with self._lock:
            current = asg is self._round  # not replaced by a new round meanwhile
            # What the members connected to us must hear now, not on their next tick: the
            # round's first loss, its first node waiting, its close. Once per round each,
            # as after it the round re-forms anyway.
            news = current and (
                bool(lost and not self.lost)
                or bool(waiting and not self.waiting)
                or closed > self.closed
            )
            if current:
                self.closed, self.waiting, self.lost = closed, waiting, lost
                self._events_seen = events
            if job_keys == self._job_keys:  # not changed meanwhile
                self._job_values = [v or b"" for v in values[after_beats:]]
            tell = current and self.node_id in lost and self._told_lost != asg.round
            if tell:
                self._told_lost = asg.round
        if news and rank in SERVING_RANKS and self.liveness.presence is not None:
            self.liveness.presence.tell_news()
        if tell:  # the others count us out: our workers must stop now
            self._tell_fenced(asg.round)

    def _read_facts(self, facts: list[str], read: list[bytes | None] | None) -> tuple[bool, int]:
        """(closed, nodes waiting for the next round) from the round's facts (``read``,
        or one read of them now); notes the published lost list and refused nodes."""
        raw_closed, raw_waiting, raw_lost, raw_refused = (
            read if read is not None else read_values(self.store, facts)
        )
        # A value not signed for this job (None) is absent; a count that is no counter
        # (anyone may write one) is nobody waiting.
        self.liveness.set_published(parse_lost(raw_lost, self.store.prefix + facts[2]))
        self._log_refused(parse_counter(raw_refused or b"") or 0)
        return bool(raw_closed), parse_counter(raw_waiting or b"") or 0

    def _log_refused(self, count: int) -> None:
        """One line per node the job turned away (its fingerprint differed)."""
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

    def _check_coordinator(self, rnd: int, coordinator: str) -> None:
        """Abandon a forming round whose coordinator stopped (``coordinator_stopped``)."""
        if self.liveness.coordinator_stopped(coordinator):
            log.warning("round %d: coordinator %s stopped; abandoning the round", rnd, coordinator)
            # The same compare_set a coordinator publishes with: exactly one outcome wins,
            # and it wakes everyone waiting for this round.
            abandoned = R.Assignment(round=rnd, state="abandoned").to_json()
            self.store.compare_set(R.assignment_key(rnd), "", abandoned)
            with self._lock:
                self._watch = None
