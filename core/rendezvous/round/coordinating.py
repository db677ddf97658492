"""The coordinator's side of a round: ``Coordinator`` is run by the node in the lowest
valid slot. It polls the round's counter (cheap: one node), reads the new join records in
one ``multi_get``, decides when the round is complete (max_nodes, the last call, or every
survivor of the last round back; never while a missing member of the last round may still
hold its lease) and publishes one assignment; a round that cannot form
within ``join_timeout`` is published abandoned, one the job closed under is published
closed.

May import the round's ``joining`` (the join-record reader, the timeout error),
``publishing``, ``monitor`` (the liveness rule), ``progress_lines``, ``settings`` and
``records``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from typing import Any

from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.joining import Joiner, timed_out
from elastic.core.rendezvous.round.liveness import LivenessTracker
from elastic.core.rendezvous.round.progress_lines import RoundProgress, membership_change
from elastic.core.rendezvous.round.publishing import RoundOutcomes
from elastic.core.rendezvous.round.settings import RoundSettings

log = logging.getLogger(__name__)

JOIN_WAIT = 0.25  # s a coordinator waiting for joiners sleeps at most between two looks


class Coordinator:
    def __init__(self, outcomes: RoundOutcomes, joiner: Joiner, settings: RoundSettings) -> None:
        self.outcomes = outcomes
        self.joiner = joiner  # whose reader reads the round's join records
        self.store = outcomes.store
        self.s = settings

    def coordinate(self, rnd: int, deadline: float, lines: RoundProgress | None) -> R.Assignment:
        """Wait until round ``rnd`` is complete and publish it; returns the outcome that
        won (this node's, or a closed one)."""
        outcomes = self.outcomes
        prev = outcomes.last_formed(rnd - 1)
        prev_roster = outcomes.roster(prev.round) if prev is not None else None
        prev_members = prev_roster.members if prev_roster is not None else []
        # Survivors of the last round we are waiting for; once all are here there is
        # nobody known to wait for, so the last call is skipped (fast re-forming). A
        # member that departs meanwhile is added to the last round's lost list and bumps
        # ``events``: the list is read again whenever ``events`` moved. One that is gone
        # without being listed (it died while no round ran, its departure's write
        # failed, or it is cut off) is found by its heartbeat (``_gone``).
        #
        # The round never forms without a member of the last round that is neither back
        # nor found gone, whatever the last call or max_nodes say: cut off from the
        # store, it still holds its lease and its workers run until the lease ends, and
        # a round formed without it meanwhile would start new workers beside them (two
        # worlds, when the cut-off members can still reach each other). Its heartbeat,
        # stale for heartbeat_timeout on our own reads, proves its lease ended (the
        # lease's argument, ``lease.py``). A member still beating that long after we
        # first read it is alive but not coming (its agent held up): the round forms
        # without it then (``_waited_out``).
        expected: set[str] = set(prev_members)
        gone: set[str] = set()
        beats = LivenessTracker(self.s.heartbeat_timeout, self.s.heartbeat_interval)
        next_beats = 0.0
        watched_at: float | None = None  # our first read of the missing members' beats
        joined: list[dict[str, Any]] = []
        seen, events, min_at, pause, clashed = 0, -1, None, 0.002, False
        while True:
            if outcomes.is_closed():
                outcomes.publish(rnd, R.Assignment(round=rnd, state="closed"))
                outcomes.raise_if_closed()
            count, now_events = self._counters(rnd)  # one read: the slots and events
            if now_events != events and prev is not None:
                events = now_events
                expected = set(prev_members) - set(outcomes.read_lost(prev.round)) - gone
            if count > seen:
                joined += self.joiner.read_slots(rnd, seen + 1, count)
                seen = count
            ids = {rec["id"] for rec in joined}
            if len(ids) < len(joined) and not clashed:
                clashed = True  # a node joins a round once: two nodes share an id
                log.warning(
                    "round %d: %d join records share a node id, so they count as one "
                    "node (ids: %s)", rnd, len(joined) - len(ids), R.repeated_ids(joined)
                )  # fmt: skip
            if lines is not None:
                lines.coordinating(self.store, rnd, joined, prev_roster, expected)
            now = time.monotonic()
            if expected - ids and now >= next_beats:
                watched_at = now if watched_at is None else watched_at
                gone |= self._gone(expected - ids, beats)
                expected -= gone
                due = beats.due()  # a frozen value's verdict read: when it is due
                next_beats = now + self.s.heartbeat_interval
                next_beats = next_beats if due is None else min(next_beats, due)
            ready = len(ids) >= self.s.max_nodes
            if len(ids) >= self.s.min_nodes:
                min_at = now if min_at is None else min_at
                if now - min_at >= self.s.last_call_timeout or (expected and expected <= ids):
                    ready = True
            if ready and expected - ids and not self._waited_out(watched_at, now):
                ready = False  # a member of the last round may still hold its lease
            if ready:
                here = self._still_here(joined)
                if len(here) == len(joined):
                    break
                joined = here  # a joiner left before the round formed: never a member
                min_at = None if len({r["id"] for r in here}) < self.s.min_nodes else min_at
                continue
            if now >= deadline:
                outcomes.publish(rnd, R.Assignment(round=rnd, state="abandoned"))
                why = f"{len(ids)} of min_nodes={self.s.min_nodes} node(s) joined"
                raise timed_out(outcomes.run_id, self.s, why)
            if expected - ids:  # survivors still to come: a departure's event counts too
                time.sleep(pause)
                pause = min(pause * 2, 0.01)  # one node polls: cheap, and adds <10 ms
            else:  # asleep until the next join (the store wakes us) or a clock is due
                due = min_at + self.s.last_call_timeout if min_at is not None else deadline
                self._await_join(rnd, seen + 1, min(deadline, due) - now)
        return self._form(rnd, joined, prev_roster)

    def _form(
        self, rnd: int, joined: list[dict[str, Any]], prev_roster: R.Roster | None
    ) -> R.Assignment:
        """Choose round ``rnd``'s members among ``joined`` and publish the formed round."""
        prev_members = prev_roster.members if prev_roster is not None else []
        prev_round = prev_roster.round if prev_roster is not None else -1
        first = R.kept_first(joined, self.s.min_nodes, prev_round, prev_members)
        deferred = len({rec["id"] for rec in joined}) - len({rec["id"] for rec in first})
        if deferred:
            log.info(
                "round %d: formed with the %d node(s) whose workers are kept; %d with "
                "workers to start join the next round", rnd, len(first), deferred
            )  # fmt: skip
        chosen = R.choose_members(first, prev_members, self.s.max_nodes)
        roster = R.Roster(
            round=rnd,
            members=[rec["id"] for rec in chosen],
            hosts=[_text(rec.get("host")) for rec in chosen],
            standbys=[_text(rec.get("standby")) for rec in chosen],
            presence=[_presence_at(rec) for rec in chosen],
        )
        asg = R.Assignment(
            round=rnd,
            state="formed",
            size=len(chosen),
            first=chosen[0]["id"],
            ranks=R.rank_runs([rec["slot"] for rec in chosen]),
            master_addr=chosen[0]["addr"],
            master_port=chosen[0]["port"],
            formed_at=time.time(),
            coordinator=self.outcomes.node_id,
            fingerprint=dict(chosen[0].get("fp") or {}),
            min_nodes=self.s.min_nodes,
            max_nodes=self.s.max_nodes,
            presence_port=_port(chosen[0].get("presence")),
            deputy=chosen[1]["id"] if len(chosen) > 1 else "",
            deputy_addr=chosen[1]["addr"] if len(chosen) > 1 else "",
            deputy_port=_port(chosen[1].get("presence")) if len(chosen) > 1 else 0,
            successors=[s for s in roster.standbys if s][: R.SUCCESSORS],
            change=membership_change(prev_roster, roster),
            deferred=deferred,
        )
        log.info(
            "round %d of run %r formed: %d node(s), master %s:%d",
            rnd,
            self.outcomes.run_id,
            len(chosen),
            asg.master_addr,
            asg.master_port,
        )
        return self.outcomes.publish(rnd, asg, roster)

    def _waited_out(self, watched_at: float | None, now: float) -> bool:
        """Whether the missing members of the last round, read since ``watched_at`` and
        not found stale, are alive and not coming: a frozen heartbeat is found stale
        heartbeat_timeout after our first read of it (``LivenessTracker.due``), so one
        interval past that, any still missing kept beating."""
        bound = self.s.heartbeat_timeout + self.s.heartbeat_interval
        return watched_at is not None and now - watched_at >= bound

    def _await_join(self, rnd: int, slot: int, seconds: float) -> None:
        """Until join slot ``slot`` of round ``rnd`` is written, or ``seconds`` (at most
        JOIN_WAIT, so a closed job is still seen): a waiting coordinator sleeps."""
        wait = timedelta(seconds=min(max(seconds, 0.001), JOIN_WAIT))
        with contextlib.suppress(StoreTimeoutError):
            self.store.wait([R.join_key(rnd, slot)], wait)

    def _counters(self, rnd: int) -> tuple[int, int]:
        """(join slots taken in round ``rnd``, the ``events`` counter), in one read."""
        raw_count, raw_events = self.store.multi_get([R.count_key(rnd), R.EVENTS])
        return _counter(raw_count), _counter(raw_events)

    def _still_here(self, joined: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The joiners whose heartbeat does not say they left (or finished) since."""
        beats = self.store.multi_get([R.hb_key(str(rec["id"])) for rec in joined])
        return [rec for rec, beat in zip(joined, beats, strict=True) if beat not in R.GONE]

    def _gone(self, nodes: set[str], beats: LivenessTracker) -> set[str]:
        """Which of ``nodes`` (last-round members not back yet) will not come: their
        heartbeat says they left or finished, or has not changed for heartbeat_timeout
        (the running round's liveness rule, ``LivenessTracker``; nobody else judges a
        member while no round runs). One read, once a heartbeat interval."""
        ids = sorted(nodes)
        asked = time.monotonic()
        values = self.store.multi_get([R.hb_key(node) for node in ids])
        lost, done = beats.update(dict(zip(ids, values, strict=True)), asked, time.monotonic())
        return set(lost) | set(done)


def _counter(raw: bytes) -> int:
    """A counter read raw (``add`` keeps decimal text); missing or garbled reads as 0."""
    try:
        return int(raw or b"0")
    except ValueError:
        return 0


def _port(value: Any) -> int:
    """A port from a join record; anything else (an older agent's record) is 0: none."""
    return value if isinstance(value, int) and 0 < value < 65536 else 0


def _presence_at(record: dict[str, Any]) -> str:
    """The "addr:port" of a joiner's presence port; "" when it has none."""
    port = _port(record.get("presence"))
    return f"{record['addr']}:{port}" if port else ""


def _text(value: Any) -> str:
    """A string from a join record; anything else (an older agent's record) is ""."""
    return value if isinstance(value, str) else ""
