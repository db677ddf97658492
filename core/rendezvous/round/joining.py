"""A joiner's side of a round: ``Joiner`` admits this node by fingerprint, reads the
round's state, takes a join slot with one ``add`` and writes its join record, reads join
records (its own coordinator's; the coordinator reads them all with the same reader;
a slot its taker never wrote is claimed empty after a short wait), and waits for the
round's outcome in one server-side wait that brings it (``wait_get``).

May import the round's ``publishing`` (the outcomes it reads), ``monitor`` (events),
``progress_lines``, ``settings``, ``signing`` and ``records``; outside the round,
``interfaces``, ``net`` and ``fingerprint``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousMismatchError,
    RendezvousTimeoutError,
)
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.rendezvous.fingerprint import describe_differences, differences
from elastic.core.rendezvous.net import free_port
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.liveness import note_event
from elastic.core.rendezvous.round.progress_lines import RoundProgress
from elastic.core.rendezvous.round.publishing import RoundOutcomes
from elastic.core.rendezvous.round.settings import RoundSettings
from elastic.core.rendezvous.round.signing import wait_present

log = logging.getLogger(__name__)

# How long a reader waits for a taken join slot's record before it claims the slot empty:
# this long, or this many of its own store round trips when the store is slower, never
# more than the most (a live joiner that misses it only takes a later slot).
EMPTY_SLOT_WAIT = 0.5
EMPTY_SLOT_TRIPS = 4
EMPTY_SLOT_WAIT_MOST = 2.0


def timed_out(run_id: str, settings: RoundSettings, why: str) -> RendezvousTimeoutError:
    """The error of a round that did not form within ``join_timeout``, saying ``why``."""
    return RendezvousTimeoutError(
        f"rendezvous of run {run_id!r} did not complete within join_timeout="
        f"{settings.join_timeout:g}s: {why}"
    )


class Joiner:
    def __init__(
        self,
        outcomes: RoundOutcomes,
        settings: RoundSettings,
        node: dict[str, Any],
        abort: Callable[[], Exception | None],
        allow_mismatch: frozenset[str],
    ) -> None:
        self.outcomes = outcomes
        self.store = outcomes.store
        self.s = settings
        self.node = node  # id, host, addr, pid, fp, rank_hint
        self._abort = abort  # the heartbeat thread's error, if it lost the store
        self.allow_mismatch = allow_mismatch
        self.admitted = False  # our fingerprint matched the job's once; it cannot change
        # Slot 1's join record of a round, as read with the round's state (b"": not yet).
        self._first_slots: dict[int, bytes] = {}

    def _admit(self, held: bytes) -> None:
        """The first joiner's fingerprint becomes the job's; a node that differs is
        refused before it takes a slot, so the running job never sees it. ``held``: the
        job's fingerprint as read with the round's state (empty: none yet, ours is
        offered)."""
        mine = self.node["fp"]
        desired = R.dumps(mine).encode()
        if not held:
            held = bytes(self.store.compare_set(R.FINGERPRINT, "", desired))
        if held != desired:
            job = R.loads(held, self.outcomes.full(R.FINGERPRINT))
            diffs = differences(job if isinstance(job, dict) else {}, mine, self.allow_mismatch)
            if diffs:
                index = self.store.add(R.REFUSED_COUNT, 1)
                note = {"host": self.node["host"], "pid": self.node["pid"], "fields": sorted(diffs)}
                self.store.set(R.refused_key(index), R.dumps(note))
                note_event(self.store)
                raise RendezvousMismatchError(describe_differences(diffs), diffs)
        self.admitted = True

    def round_state(self) -> tuple[int, bytes, R.Assignment | None]:
        """(the current round, the round key as read, that round's outcome or None),
        having raised if the job is closed, then if this node's fingerprint differs from
        the job's (a closed job says so before refusing a mismatch): one read when the
        round is the newest this node joined (or 0), which it is when a round forms or
        re-forms. The same read takes the job's fingerprint until this node was admitted,
        and the first join record of that round and the next (``_first_slots``): the
        round this node joins next is one of them, and its first slot is most often
        taken already, so a joiner learns its coordinator without a read of its own."""
        outcomes = self.outcomes
        guess = max(outcomes.joined, 0)
        keys = [R.CLOSED, R.ROUND, R.assignment_key(guess)]
        keys += [R.join_key(guess, 1), R.join_key(guess + 1, 1)]
        admitting = not self.admitted and bool(self.node.get("fp"))
        if admitting:
            keys.append(R.FINGERPRINT)
        raw_closed, raw_round, raw_asg, first, next_first, *fingerprint = self.store.multi_get(keys)
        self._first_slots = {guess: first, guess + 1: next_first}
        if raw_closed:
            outcomes.raise_closed(raw_closed)
        if admitting:
            self._admit(bytes(fingerprint[0]))
        rnd = outcomes.round_number(raw_round)
        if rnd != guess:
            return rnd, raw_round, outcomes.read_assignment(rnd)
        return rnd, raw_round, outcomes.assignment(raw_asg, rnd)

    def take_slot(self, rnd: int) -> int:
        """Take a join slot in round ``rnd`` and write this node's join record there, with
        ``compare_set`` from absent: a reader that found the slot still empty may have
        claimed it empty meanwhile (``read_slots``), and then this node takes another."""
        record = dict(self.node, round=rnd, port=free_port(self.node["addr"]), t=time.time())
        desired = R.dumps(record)
        while True:
            slot = self.store.add(R.count_key(rnd), 1)
            held = self.store.compare_set(R.join_key(rnd, slot), "", desired)
            if held == desired.encode():
                break
            log.info(
                "round %d: join slot %d was claimed empty before this node wrote its "
                "record there (a slow store); taking another", rnd, slot
            )  # fmt: skip
        if rnd > 0:  # the running round's members count the next round's joiners
            note_event(self.store)
        return slot

    def read_slots(self, rnd: int, first: int, last: int) -> list[dict[str, Any]]:
        """The valid join records in slots first..last, in slot order, each with its
        ``slot`` (as the key says, whatever the record does)."""
        slots = range(first, last + 1)
        keys = [R.join_key(rnd, i) for i in slots]
        if not keys:
            return []
        asked = time.monotonic()
        values = dict(zip(keys, self.store.multi_get(keys), strict=True))
        missing = [key for key, raw in values.items() if not raw]
        if missing:  # taken, not written yet (or foreign)
            # A slot is written one round trip after it is taken; one still empty after
            # a few of ours is claimed empty, so that a joiner killed between the two
            # costs nobody read_timeout. The claim and the record are both a
            # compare_set from absent: exactly one lands, so a live joiner that was too
            # slow finds the claim and takes a later slot, never skipped unseen.
            trip = time.monotonic() - asked
            bound = max(EMPTY_SLOT_WAIT, EMPTY_SLOT_TRIPS * trip)
            bound = min(bound, EMPTY_SLOT_WAIT_MOST, self.s.read_timeout)
            try:
                wait_present(self.store, missing, timedelta(seconds=bound))
            except StoreTimeoutError:
                pass
            values.update(zip(missing, self.store.multi_get(missing), strict=True))
            for key in [key for key in missing if not values[key]]:
                values[key] = self.store.compare_set(key, "", R.EMPTY_SLOT)
        records = (self._join_record(rnd, i, values[k]) for i, k in zip(slots, keys, strict=True))
        return [record for record in records if record is not None]

    def _join_record(self, rnd: int, slot: int, raw: bytes) -> dict[str, Any] | None:
        """The join record read at ``slot``, with its slot; None when absent, foreign
        (not signed for this job and slot) or malformed (said once, here)."""
        if not raw:
            return None
        key = self.outcomes.full(R.join_key(rnd, slot))
        record = R.loads(raw, key)
        if R.is_empty_slot(record):
            return None  # its taker never wrote it (``read_slots``)
        if not R.valid_join(record, rnd):
            log.warning("ignoring malformed join record at %s", key)
            return None
        return dict(record, slot=slot)

    def find_coordinator(self, rnd: int, slot: int) -> tuple[int, str] | None:
        """(slot, node id) of the lowest valid slot, the coordinator; None when it is us."""
        first = self._first_slots.pop(rnd, b"")
        for i in range(1, slot):
            if i == 1 and first:  # read with the round's state (``round_state``)
                record = self._join_record(rnd, 1, first)
                found = [record] if record is not None else []
            else:
                found = self.read_slots(rnd, i, i)
            if found:
                return i, str(found[0]["id"])
        if rnd == 0:  # the job's first coordinator: the round key says the job exists
            self.store.compare_set(R.ROUND, "", "0")
        return None

    def await_outcome(self, rnd: int, deadline: float, lines: RoundProgress | None) -> R.Assignment:
        """Block in one server-side wait on round ``rnd``'s outcome until it is published
        (and read it with the answer), the store is lost or ``deadline`` passes."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise timed_out(self.outcomes.run_id, self.s, "no assignment was published")
        sent = time.monotonic()  # no later than the WAIT goes out

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
            # The outcome comes with the answer: one round trip, not a wait and a read.
            (raw,) = self.store.wait_get(
                [R.assignment_key(rnd)], timedelta(seconds=remaining), tick
            )
        except StoreTimeoutError:
            raise timed_out(self.outcomes.run_id, self.s, "no assignment was published") from None
        asg = self.outcomes.assignment(raw, rnd)
        assert asg is not None
        self.outcomes.outcome_sent = sent
        return asg
