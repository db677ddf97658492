"""The round algorithm: O(N) store operations per round in total. ``RoundProtocol`` runs
the loop that joins rounds until one forms with this node in it, and hands each job to
its room: ``joining`` (admission, a slot, the wait for the outcome), ``coordinating`` (the
lowest slot decides the round) and ``publishing`` (the round key, outcomes, rosters, the
closed mark).

A joiner takes a slot with one ``add`` on the round's counter and writes its own join
record; the lowest valid slot coordinates: it polls the counter (cheap: one node), reads
the new records in one ``multi_get``, decides when the round is complete and publishes one
assignment with ``compare_set``. Everyone else blocks in one server-side ``wait`` on that
key. The same ``compare_set`` is how a round is abandoned (dead coordinator, timeout) or
closed, so a waiter is always woken by exactly one key and nothing polls in a loop.

May import the round's ``coordinating``, ``joining``, ``publishing``, ``progress_lines``,
``settings`` and ``records``; outside the round, ``interfaces``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.coordinating import Coordinator
from elastic.core.rendezvous.round.joining import Joiner, timed_out
from elastic.core.rendezvous.round.progress_lines import RoundProgress, Say
from elastic.core.rendezvous.round.publishing import RoundOutcomes
from elastic.core.rendezvous.round.settings import RoundSettings

WATCHERS = 3  # waiters (the slots after the coordinator's) that watch the coordinator


class RoundProtocol:
    def __init__(
        self,
        store: CoordinationStore,
        settings: RoundSettings,
        run_id: str,
        node: dict[str, Any],
        phase: Callable[[tuple[int, str] | None, bool], None],
        abort: Callable[[], Exception | None] = lambda: None,
        allow_mismatch: frozenset[str] = frozenset(),
    ) -> None:
        self.store = store
        self.s = settings
        self.run_id = run_id
        self.node = node  # id, host, addr, pid, fp, rank_hint
        self.node_id: str = node["id"]
        self._phase = phase  # tells the heartbeat thread whom to watch, whether to beat
        self.outcomes = RoundOutcomes(store, run_id, self.node_id)
        self.joiner = Joiner(self.outcomes, settings, node, abort, allow_mismatch)
        self.coordinator = Coordinator(self.outcomes, self.joiner, settings)
        # Waiting lines (progress_lines.py): the callback that prints them.
        self.progress: Say | None = None
        self._lines: RoundProgress | None = None
        self._member_of = -1  # the newest round this node is a member of

    # -- what rounds decided (``publishing``) -------------------------------------------
    @property
    def outcome_sent(self) -> float | None:
        """When the request that brought the last outcome was sent (``Lease.arm``)."""
        return self.outcomes.outcome_sent

    def current_round(self) -> int:
        return self.outcomes.current_round()

    def read_assignment(self, rnd: int) -> R.Assignment | None:
        return self.outcomes.read_assignment(rnd)

    def last_formed(self, rnd: int) -> R.Assignment | None:
        return self.outcomes.last_formed(rnd)

    def roster(self, rnd: int) -> R.Roster:
        return self.outcomes.roster(rnd)

    def is_closed(self) -> bool:
        return self.outcomes.is_closed()

    def set_closed(self) -> None:
        self.outcomes.set_closed()

    # -- the joining loop -------------------------------------------------------------
    def next_round(self) -> tuple[R.Assignment, int]:
        """Join rounds until one forms with this node in it: its outcome and our rank."""
        outcomes, joiner = self.outcomes, self.joiner
        deadline = time.monotonic() + self.s.join_timeout
        if self.progress is not None:
            self._lines = RoundProgress(self.progress, self.s.min_nodes, self.s.max_nodes, deadline)
        while True:
            rnd, raw_round, asg = joiner.round_state()
            if asg is None:
                target = rnd
            elif asg.state == "closed":
                outcomes.raise_if_closed()
                target = rnd + 1
            elif asg.state == "abandoned":
                target = rnd + 1
            elif rnd == self._member_of or asg.size < self.s.max_nodes:
                # A member asking again wants a new round; a newcomer to a job with room
                # joins the next one, which members see as num_nodes_waiting() > 0.
                target = rnd + 1
            else:
                self._standby(rnd, deadline)  # full job: wait until someone re-forms it
                continue
            target = max(target, outcomes.joined + 1)  # an old round's outcome is not ours
            if target != rnd:
                self.store.compare_set(R.ROUND, raw_round, str(target))
            result = self._join(target, deadline)
            outcomes.joined = target  # its outcome is out: formed, abandoned or closed
            if result is not None:
                return result

    def _standby(self, rnd: int, deadline: float) -> None:
        pause = min(0.25, self.s.heartbeat_interval)
        while not self.store.check([R.count_key(rnd + 1)]):
            self.outcomes.raise_if_closed()
            if time.monotonic() >= deadline:
                raise timed_out(
                    self.run_id, self.s, "the job is full (max_nodes) and never re-formed"
                )
            if self._lines is not None:
                self._lines.standby()
            time.sleep(pause)

    def _join(self, rnd: int, deadline: float) -> tuple[R.Assignment, int] | None:
        slot = self.joiner.take_slot(rnd)
        found = self.joiner.find_coordinator(rnd, slot)
        if found is None:
            self._phase(None, False)  # the waiters' watchers read our heartbeat
            asg = self.coordinator.coordinate(rnd, deadline, self._lines)
        else:
            # While we wait only the coordinator's liveness matters: we stay quiet, and
            # only the next few slots watch it (a round of N waiters costs O(1) per tick).
            coord_slot, coordinator = found
            watcher = slot - coord_slot <= WATCHERS
            self._phase((rnd, coordinator) if watcher else None, True)
            try:
                asg = self.joiner.await_outcome(rnd, deadline, self._lines)
            except BaseException:
                self._phase(None, False)
                raise
        rank = asg.rank_of(slot) if asg.state == "formed" else None
        if found is not None:
            # Formed with us: quiet until the round's first keep-alive (``Lease.arm``),
            # so one goes out, not two at once.
            self._phase(None, rank is not None)
        if asg.state == "closed":
            self.outcomes.raise_if_closed()
        if rank is None:
            return None  # abandoned, or formed without us: go round again
        self._member_of = rnd
        return asg, rank
