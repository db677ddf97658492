"""What rounds decided, as the store holds it: ``RoundOutcomes`` reads and publishes the
round key, each round's outcome (its assignment) and a formed round's roster, and the
job's closed mark.

An outcome is published with one ``compare_set`` on the round's assignment key, so
whichever outcome (formed, abandoned, closed) lands first is the round's, and every waiter
is woken by exactly that key. Rounds only advance: the round key never reads below the
newest round this node joined.

May import the round's ``monitor`` (events, the lost list) and ``records``, and
``interfaces``.
"""

from __future__ import annotations

import time

from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousReusedIdError,
    RendezvousStateError,
)
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.liveness import note_event, read_lost


class RoundOutcomes:
    def __init__(self, store: CoordinationStore, run_id: str, node_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.node_id = node_id
        # A job closed before this is another job that had our run id (a reused id).
        self.started_at = time.time()
        # The newest round this node joined: it never joins one again, and never lets
        # the round key go back below it (a replayed or foreign value set it back).
        self.joined = -1
        # When the request that brought the last outcome (a WAIT, or the coordinator's
        # publishing) was sent: the store answered it, so it counts as a keep-alive
        # acknowledged (``Lease.arm``).
        self.outcome_sent: float | None = None
        self._rosters: dict[int, R.Roster] = {}  # rounds' rosters as published or read

    def full(self, key: str) -> str:
        return self.store.prefix + key

    # -- the round key ----------------------------------------------------------------
    def current_round(self) -> int:
        (raw,) = self.store.multi_get([R.ROUND])
        return self.round_number(raw)

    def round_number(self, raw: bytes) -> int:
        """The round key's value as a round: absent is round 0 (its first node writes
        it, ``Joiner.find_coordinator``); never below the newest round this node joined."""
        try:
            rnd = int(raw) if raw else 0
        except ValueError:
            raise RendezvousStateError(
                f"rendezvous state key {self.full(R.ROUND)!r} is not a round number: "
                f"{bytes(raw[:60])!r}"
            ) from None
        if rnd < self.joined:
            # Rounds only advance: an older value is a replayed record, or a foreign one
            # that was reset. Put back the newest we know.
            self.store.compare_set(R.ROUND, raw, str(self.joined))
            return self.joined
        return rnd

    # -- outcomes and rosters ---------------------------------------------------------
    def read_assignment(self, rnd: int) -> R.Assignment | None:
        key = R.assignment_key(rnd)
        if rnd < 0:
            return None
        # One read: a missing (or foreign) value reads as b"", as a CHECK would say.
        (raw,) = self.store.multi_get([key])
        return self.assignment(raw, rnd)

    def assignment(self, raw: bytes, rnd: int) -> R.Assignment | None:
        """Round ``rnd``'s outcome as read (``b""``: none yet)."""
        if not raw:
            return None
        return R.Assignment.from_json(raw, self.full(R.assignment_key(rnd)), rnd)

    def last_formed(self, rnd: int) -> R.Assignment | None:
        """The newest formed round at or before ``rnd`` (abandoned ones are skipped)."""
        for back in range(rnd, max(-1, rnd - 5), -1):
            asg = self.read_assignment(back)
            if asg is not None and asg.state == "formed":
                return asg
        return None

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

    # -- closing ----------------------------------------------------------------------
    def is_closed(self) -> bool:
        return self.store.check([R.CLOSED])

    def set_closed(self) -> None:
        self.store.set(R.CLOSED, R.closed_record(self.node_id))
        note_event(self.store)
        rnd = self.current_round()
        # Wake whoever waits on an unformed round; a formed one learns it by heartbeat.
        self.publish(rnd, R.Assignment(round=rnd, state="closed"))

    def raise_if_closed(self) -> None:
        (raw,) = self.store.multi_get([R.CLOSED])
        if raw:
            self.raise_closed(raw)

    def raise_closed(self, raw: bytes) -> None:
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
