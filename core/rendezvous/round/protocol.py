"""The round algorithm: O(N) store operations per round in total.

A joiner takes a slot with one ``add`` on the round's counter and writes its own join
record; the lowest valid slot coordinates: it polls the counter (cheap: one node), reads
the new records in one ``multi_get``, decides when the round is complete and publishes one
assignment with ``compare_set``. Everyone else blocks in one server-side ``wait`` on that
key. The same ``compare_set`` is how a round is abandoned (dead coordinator, timeout) or
closed, so a waiter is always woken by exactly one key and nothing polls in a loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousMismatchError,
    RendezvousReusedIdError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.rendezvous.fingerprint import describe_differences, differences
from elastic.core.rendezvous.net import free_port
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.monitor import LivenessTracker, note_event, read_lost
from elastic.core.rendezvous.round.progress_lines import RoundProgress, Say, membership_change
from elastic.core.rendezvous.round.settings import RoundSettings
from elastic.core.rendezvous.round.signing import wait_present

log = logging.getLogger(__name__)

WATCHERS = 3  # waiters (the slots after the coordinator's) that watch the coordinator
JOIN_WAIT = 0.25  # s a coordinator waiting for joiners sleeps at most between two looks


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
        self._abort = abort  # the heartbeat thread's error, if it lost the store
        self.allow_mismatch = allow_mismatch
        self._admitted = False  # our fingerprint matched the job's once; it cannot change
        # A job closed before this is another job that had our run id (a reused id).
        self.started_at = time.time()
        # The newest round this node joined: it never joins one again, and never lets
        # the round key go back below it (a replayed or foreign value set it back).
        self._joined = -1
        # Waiting lines (progress_lines.py): the callback that prints them.
        self.progress: Say | None = None
        self._lines: RoundProgress | None = None
        # When the request that brought the last outcome (a WAIT, or the coordinator's
        # publishing) was sent: the store answered it, so it counts as a keep-alive
        # acknowledged (``Lease.arm``).
        self.outcome_sent: float | None = None
        # Slot 1's join record of a round, as read with the round's state (b"": not yet).
        self._first_slots: dict[int, bytes] = {}
        self._member_of = -1  # the newest round this node is a member of
        self._rosters: dict[int, R.Roster] = {}  # rounds' rosters as published or read

    # -- reading state ----------------------------------------------------------------
    def full(self, key: str) -> str:
        return self.store.prefix + key

    def current_round(self) -> int:
        (raw,) = self.store.multi_get([R.ROUND])
        return self._round_number(raw)

    def _round_number(self, raw: bytes) -> int:
        """The round key's value as a round: absent is round 0 (its first node writes
        it, ``_join``); never below the newest round this node joined."""
        try:
            rnd = int(raw) if raw else 0
        except ValueError:
            raise RendezvousStateError(
                f"rendezvous state key {self.full(R.ROUND)!r} is not a round number: "
                f"{bytes(raw[:60])!r}"
            ) from None
        if rnd < self._joined:
            # Rounds only advance: an older value is a replayed record, or a foreign one
            # that was reset. Put back the newest we know.
            self.store.compare_set(R.ROUND, raw, str(self._joined))
            return self._joined
        return rnd

    def _round_state(self) -> tuple[int, bytes, R.Assignment | None]:
        """(the current round, the round key as read, that round's outcome or None),
        having raised if the job is closed: one read when the round is the newest this
        node joined (or 0), which it is when a round forms or re-forms. The same read
        takes the first join record of that round and the next (``_first_slots``): the
        round this node joins next is one of them, and its first slot is most often
        taken already, so a joiner learns its coordinator without a read of its own."""
        guess = max(self._joined, 0)
        keys = [R.CLOSED, R.ROUND, R.assignment_key(guess)]
        keys += [R.join_key(guess, 1), R.join_key(guess + 1, 1)]
        raw_closed, raw_round, raw_asg, first, next_first = self.store.multi_get(keys)
        self._first_slots = {guess: first, guess + 1: next_first}
        if raw_closed:
            self._raise_closed(raw_closed)
        rnd = self._round_number(raw_round)
        if rnd != guess:
            return rnd, raw_round, self.read_assignment(rnd)
        return rnd, raw_round, self._assignment(raw_asg, rnd)

    def read_assignment(self, rnd: int) -> R.Assignment | None:
        key = R.assignment_key(rnd)
        if rnd < 0:
            return None
        # One read: a missing (or foreign) value reads as b"", as a CHECK would say.
        (raw,) = self.store.multi_get([key])
        return self._assignment(raw, rnd)

    def _assignment(self, raw: bytes, rnd: int) -> R.Assignment | None:
        """Round ``rnd``'s outcome as read (``b""``: none yet)."""
        if not raw:
            return None
        return R.Assignment.from_json(raw, self.full(R.assignment_key(rnd)), rnd)

    def roster(self, rnd: int) -> R.Roster:
        """Formed round ``rnd``'s members by rank: one read, or none where this node
        published it (the coordinator) or read it before."""
        roster = self._rosters.get(rnd)
        if roster is None:
            key = R.roster_key(rnd)
            (raw,) = self.store.multi_get([key])
            if not raw:  # written before the outcome: absent is foreign, or a bug
                raise RendezvousStateError(
                    f"round {rnd} formed but {self.full(key)!r} holds no roster for this job"
                )
            roster = R.Roster.from_json(raw, self.full(key), rnd)
            self._keep_roster(roster)
        return roster

    def _keep_roster(self, roster: R.Roster) -> None:
        """Remember ``roster``, and the one before it (the next round's coordinator reads
        it); older ones are dropped, so a long job keeps two."""
        kept = {k: v for k, v in self._rosters.items() if k >= roster.round - 1}
        self._rosters = {**kept, roster.round: roster}

    def read_lost(self, rnd: int) -> list[str]:
        return read_lost(self.store, rnd)

    def is_closed(self) -> bool:
        return self.store.check([R.CLOSED])

    def _raise_if_closed(self) -> None:
        (raw,) = self.store.multi_get([R.CLOSED])
        if raw:
            self._raise_closed(raw)

    def _raise_closed(self, raw: bytes) -> None:
        at = R.closed_at(raw)
        if at is not None and at < self.started_at:
            # This node started after the job closed: it was never one of its nodes.
            when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(at))
            raise RendezvousReusedIdError(
                f"--rdzv-id={self.run_id} names a job that already finished (at {when}, "
                f"before this agent started) on the store at {self.store.where}: give this "
                "job a new --rdzv-id"
            )
        raise RendezvousClosedError(
            f"the rendezvous of run {self.run_id!r} is closed (the job has finished)"
        )

    def publish(self, rnd: int, asg: R.Assignment, roster: R.Roster | None = None) -> R.Assignment:
        """compare_set the round's outcome (a formed one's ``roster`` first, so whoever
        reads the outcome finds it); returns whichever outcome won."""
        if roster is not None:
            self.store.set(R.roster_key(rnd), roster.to_json())
        desired = asg.to_json().encode()
        sent = time.monotonic()
        held = self.store.compare_set(R.assignment_key(rnd), "", desired)
        self.outcome_sent = sent
        if held == desired:
            if roster is not None:
                self._keep_roster(roster)
            return asg
        return R.Assignment.from_json(held, self.full(R.assignment_key(rnd)), rnd)

    def set_closed(self) -> None:
        self.store.set(R.CLOSED, R.closed_record(self.node_id))
        note_event(self.store)
        rnd = self.current_round()
        # Wake whoever waits on an unformed round; a formed one learns it by heartbeat.
        self.publish(rnd, R.Assignment(round=rnd, state="closed"))

    # -- joining ----------------------------------------------------------------------
    def check_fingerprint(self) -> None:
        """The first joiner's fingerprint becomes the job's; a node that differs is
        refused before it takes a slot, so the running job never sees it."""
        mine = self.node.get("fp") or {}
        if self._admitted or not mine:
            return
        desired = R.dumps(mine).encode()
        held = bytes(self.store.compare_set(R.FINGERPRINT, "", desired))
        if held != desired:
            job = R.loads(held, self.full(R.FINGERPRINT))
            diffs = differences(job if isinstance(job, dict) else {}, mine, self.allow_mismatch)
            if diffs:
                index = self.store.add(R.REFUSED_COUNT, 1)
                note = {"host": self.node["host"], "pid": self.node["pid"], "fields": sorted(diffs)}
                self.store.set(R.refused_key(index), R.dumps(note))
                note_event(self.store)
                raise RendezvousMismatchError(describe_differences(diffs), diffs)
        self._admitted = True

    def next_round(self) -> tuple[R.Assignment, int]:
        """Join rounds until one forms with this node in it: its outcome and our rank."""
        if not self._admitted and self.node.get("fp"):
            self._raise_if_closed()  # a closed job says so before refusing a mismatch
        self.check_fingerprint()
        deadline = time.monotonic() + self.s.join_timeout
        if self.progress is not None:
            self._lines = RoundProgress(self.progress, self.s.min_nodes, self.s.max_nodes, deadline)
        while True:
            rnd, raw_round, asg = self._round_state()
            if asg is None:
                target = rnd
            elif asg.state == "closed":
                self._raise_if_closed()
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
            target = max(target, self._joined + 1)  # an old round's outcome is not ours
            if target != rnd:
                self.store.compare_set(R.ROUND, raw_round, str(target))
            result = self._join(target, deadline)
            self._joined = target  # its outcome is out: formed, abandoned or closed
            if result is not None:
                return result

    def _standby(self, rnd: int, deadline: float) -> None:
        pause = min(0.25, self.s.heartbeat_interval)
        while not self.store.check([R.count_key(rnd + 1)]):
            self._raise_if_closed()
            if time.monotonic() >= deadline:
                raise self._timeout("the job is full (max_nodes) and never re-formed")
            if self._lines is not None:
                self._lines.standby()
            time.sleep(pause)

    def _timeout(self, why: str) -> RendezvousTimeoutError:
        return RendezvousTimeoutError(
            f"rendezvous of run {self.run_id!r} did not complete within join_timeout="
            f"{self.s.join_timeout:g}s: {why}"
        )

    def _join(self, rnd: int, deadline: float) -> tuple[R.Assignment, int] | None:
        record = dict(self.node, round=rnd, port=free_port(self.node["addr"]), t=time.time())
        slot = self.store.add(R.count_key(rnd), 1)
        self.store.set(R.join_key(rnd, slot), R.dumps(record))
        if rnd == 0 and slot == 1:  # the job's first node: the round key says it exists
            self.store.compare_set(R.ROUND, "", "0")
        if rnd > 0:  # the running round's members count the next round's joiners
            note_event(self.store)
        found = self._find_coordinator(rnd, slot)
        if found is None:
            self._phase(None, False)  # the waiters' watchers read our heartbeat
            asg = self._coordinate(rnd, deadline)
        else:
            # While we wait only the coordinator's liveness matters: we stay quiet, and
            # only the next few slots watch it (a round of N waiters costs O(1) per tick).
            coord_slot, coordinator = found
            watcher = slot - coord_slot <= WATCHERS
            self._phase((rnd, coordinator) if watcher else None, True)
            try:
                asg = self._await(rnd, deadline)
            except BaseException:
                self._phase(None, False)
                raise
        rank = asg.rank_of(slot) if asg.state == "formed" else None
        if found is not None:
            # Formed with us: quiet until the round's first keep-alive (``Lease.arm``),
            # so one goes out, not two at once.
            self._phase(None, rank is not None)
        if asg.state == "closed":
            self._raise_if_closed()
        if rank is None:
            return None  # abandoned, or formed without us: go round again
        self._member_of = rnd
        return asg, rank

    def _read_slots(self, rnd: int, first: int, last: int) -> list[dict[str, Any]]:
        """The valid join records in slots first..last, in slot order, each with its
        ``slot`` (as the key says, whatever the record does)."""
        slots = range(first, last + 1)
        keys = [R.join_key(rnd, i) for i in slots]
        if not keys:
            return []
        values = dict(zip(keys, self.store.multi_get(keys), strict=True))
        missing = [key for key, raw in values.items() if not raw]
        if missing:  # taken, not written yet (or foreign): wait, then read those again
            try:  # a slot is written right after it is taken: this wait is short
                wait_present(self.store, missing, timedelta(seconds=self.s.read_timeout))
            except StoreTimeoutError:
                pass  # a joiner died between add and set: its slot reads empty, is skipped
            values.update(zip(missing, self.store.multi_get(missing), strict=True))
        records = (self._join_record(rnd, i, values[k]) for i, k in zip(slots, keys, strict=True))
        return [record for record in records if record is not None]

    def _join_record(self, rnd: int, slot: int, raw: bytes) -> dict[str, Any] | None:
        """The join record read at ``slot``, with its slot; None when absent, foreign
        (not signed for this job and slot) or malformed (said once, here)."""
        if not raw:
            return None
        key = self.full(R.join_key(rnd, slot))
        record = R.loads(raw, key)
        if not R.valid_join(record, rnd):
            log.warning("ignoring malformed join record at %s", key)
            return None
        return dict(record, slot=slot)

    def _find_coordinator(self, rnd: int, slot: int) -> tuple[int, str] | None:
        """(slot, node id) of the lowest valid slot, the coordinator; None when it is us."""
        first = self._first_slots.pop(rnd, b"")
        for i in range(1, slot):
            if i == 1 and first:  # read with the round's state (``_round_state``)
                record = self._join_record(rnd, 1, first)
                found = [record] if record is not None else []
            else:
                found = self._read_slots(rnd, i, i)
            if found:
                return i, str(found[0]["id"])
        return None

    def _await(self, rnd: int, deadline: float) -> R.Assignment:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timeout("no assignment was published")
        sent = time.monotonic()  # no later than the WAIT goes out
        lines = self._lines

        def tick() -> None:
            # Give up as soon as the heartbeat thread finds the store unreachable (a host
            # that vanished without a TCP reset would otherwise hold this wait until
            # join_timeout); say a waiting line when one is due.
            error = self._abort()
            if error is not None:
                raise RendezvousConnectionError(str(error))
            if lines is not None:
                lines.waiting(self.store, rnd)

        try:
            self.store.wait([R.assignment_key(rnd)], timedelta(seconds=remaining), tick)
        except StoreTimeoutError:
            raise self._timeout("no assignment was published") from None
        asg = self.read_assignment(rnd)
        assert asg is not None
        self.outcome_sent = sent
        return asg

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

    def last_formed(self, rnd: int) -> R.Assignment | None:
        """The newest formed round at or before ``rnd`` (abandoned ones are skipped)."""
        for back in range(rnd, max(-1, rnd - 5), -1):
            asg = self.read_assignment(back)
            if asg is not None and asg.state == "formed":
                return asg
        return None

    def _coordinate(self, rnd: int, deadline: float) -> R.Assignment:
        prev = self.last_formed(rnd - 1)
        prev_roster = self.roster(prev.round) if prev is not None else None
        prev_members = prev_roster.members if prev_roster is not None else []
        # Survivors of the last round we are waiting for; once all are here there is
        # nobody known to wait for, so the last call is skipped (fast re-forming). A
        # member that departs meanwhile is added to the last round's lost list and bumps
        # ``events``: the list is read again whenever ``events`` moved. One that is gone
        # without being listed (it died while no round ran, or its departure's write
        # failed) is found by its heartbeat (``_gone``) during the last call.
        expected: set[str] = set(prev_members)
        gone: set[str] = set()
        beats = LivenessTracker(self.s.heartbeat_timeout, self.s.heartbeat_interval)
        next_beats = 0.0
        joined: list[dict[str, Any]] = []
        seen, events, min_at, pause, clashed = 0, -1, None, 0.002, False
        while True:
            if self.is_closed():
                self.publish(rnd, R.Assignment(round=rnd, state="closed"))
                self._raise_if_closed()
            count, now_events = self._counters(rnd)  # one read: the slots and events
            if now_events != events and prev is not None:
                events = now_events
                expected = set(prev_members) - set(self.read_lost(prev.round)) - gone
            if count > seen:
                joined += self._read_slots(rnd, seen + 1, count)
                seen = count
            ids = {rec["id"] for rec in joined}
            if len(ids) < len(joined) and not clashed:
                clashed = True  # a node joins a round once: two nodes share an id
                log.warning(
                    "round %d: %d join records share a node id, so they count as one "
                    "node (ids: %s)", rnd, len(joined) - len(ids), R.repeated_ids(joined)
                )  # fmt: skip
            if self._lines is not None:
                self._lines.coordinating(self.store, rnd, joined, prev_roster, expected)
            now = time.monotonic()
            ready = len(ids) >= self.s.max_nodes
            if len(ids) >= self.s.min_nodes:
                min_at = now if min_at is None else min_at
                if expected - ids and now >= next_beats:
                    next_beats = now + self.s.heartbeat_interval
                    gone |= self._gone(expected - ids, beats)
                    expected -= gone
                if now - min_at >= self.s.last_call_timeout or (expected and expected <= ids):
                    ready = True
            if ready:
                here = self._still_here(joined)
                if len(here) == len(joined):
                    break
                joined = here  # a joiner left before the round formed: never a member
                min_at = None if len({r["id"] for r in here}) < self.s.min_nodes else min_at
                continue
            if now >= deadline:
                self.publish(rnd, R.Assignment(round=rnd, state="abandoned"))
                raise self._timeout(f"{len(ids)} of min_nodes={self.s.min_nodes} node(s) joined")
            if expected - ids:  # survivors still to come: a departure's event counts too
                time.sleep(pause)
                pause = min(pause * 2, 0.01)  # one node polls: cheap, and adds <10 ms
            else:  # asleep until the next join (the store wakes us) or a clock is due
                last_call = min_at + self.s.last_call_timeout if min_at is not None else deadline
                self._await_join(rnd, seen + 1, min(deadline, last_call) - now)
        chosen = R.choose_members(joined, prev_members, self.s.max_nodes)
        roster = R.Roster(
            round=rnd,
            members=[rec["id"] for rec in chosen],
            hosts=[_text(rec.get("host")) for rec in chosen],
            standbys=[_text(rec.get("standby")) for rec in chosen],
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
            coordinator=self.node_id,
            fingerprint=dict(chosen[0].get("fp") or {}),
            min_nodes=self.s.min_nodes,
            max_nodes=self.s.max_nodes,
            presence_port=_port(chosen[0].get("presence")),
            successors=[s for s in roster.standbys if s][: R.SUCCESSORS],
            change=membership_change(prev_roster, roster),
        )
        log.info(
            "round %d of run %r formed: %d node(s), master %s:%d",
            rnd,
            self.run_id,
            len(chosen),
            asg.master_addr,
            asg.master_port,
        )
        return self.publish(rnd, asg, roster)


def _counter(raw: bytes) -> int:
    """A counter read raw (``add`` keeps decimal text); missing or garbled reads as 0."""
    try:
        return int(raw or b"0")
    except ValueError:
        return 0


def _port(value: Any) -> int:
    """A port from a join record; anything else (an older agent's record) is 0: none."""
    return value if isinstance(value, int) and 0 < value < 65536 else 0


def _text(value: Any) -> str:
    """A string from a join record; anything else (an older agent's record) is ""."""
    return value if isinstance(value, str) else ""
