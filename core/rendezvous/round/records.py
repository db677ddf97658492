"""Keys, JSON records and signatures of the shared rendezvous round.

Layout under ``<job prefix>/rdzv/`` (the agent's job-wide keys live beside it, under the
job prefix), the same on every coordination store::

    round                 the newest round number anyone joined (compare_set to advance)
    closed                once the rendezvous is closed: who closed it and when (JSON)
    events                a counter bumped after anything a member's heartbeat thread must
                          notice (closed, a node lost or refused, a joiner for a next round),
                          so an idle tick reads one counter instead of every such key
    hb/<node_id>          "<seq> <unix time>", rewritten each heartbeat; at the end "done"
                          (its workers finished the job) or "left" (it departed)
    r/<n>/count           arrival counter of round n (``add``): a joiner's slot number
    r/<n>/join/<slot>     the join record of that slot (JSON), or ``EMPTY_SLOT``: claimed
                          empty by a reader, its taker never wrote it in time (it died)
    r/<n>/assignment      the outcome every node reads: formed / abandoned / closed, and
                          for a formed round what a node needs to start (its rank by its
                          join slot, the world size, the master): O(1) in the round's size
                          for a first round (JSON, compare_set once)
    r/<n>/roster          a formed round's members by rank: node ids, hosts, standbys
                          (JSON, written before the outcome); read only by those that need
                          every member (rank 0, the next round's coordinator, ``status``),
                          so a round of N does not send N ids to each of N nodes
    r/<n>/lost            members of round n found dead or departed (JSON list)
    r/<n>/progress        while round n forms: who joined, who is missing (the coordinator's,
                          for the others' waiting lines; ``progress_lines.py``)

Everything is JSON; nothing read from the store is ever unpickled. With a job token every
value but the counters is signed and bound to its key and job (``signing.py``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from elastic.core.interfaces.rendezvous import MembershipChange, RendezvousStateError

log = logging.getLogger(__name__)

ROUND = "round"
CLOSED = "closed"
EVENTS = "events"
FINGERPRINT = "fingerprint"  # the first joiner's fingerprint: the job's
REFUSED_COUNT = "refused/count"  # nodes turned away for a fingerprint mismatch


def refused_key(index: int) -> str:
    return f"refused/{index}"


DONE = b"done"  # finished: the job is complete for this node
LEFT = b"left"  # departed (signalled) while the job goes on: never "done"
GONE = frozenset({DONE, LEFT})  # a heartbeat that says its node will not train again


def closed_record(node_id: str) -> str:
    """What ``closed`` holds: who closed the job and when (wall clock), so an agent
    started after that knows it was given a finished job's id, not a late place in it."""
    return dumps({"at": time.time(), "by": node_id})


def closed_at(raw: bytes) -> float | None:
    """When the job closed, from ``closed``'s value; None when it does not say."""
    try:
        at = json.loads(raw).get("at")
        return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None
    except (ValueError, AttributeError, OverflowError, RecursionError):
        return None


def new_node_id() -> str:
    """``host:pid:<48 random bits>``. A round counts its members by id, so two nodes
    with one id stall it until join_timeout; host and pid can repeat (handlers in one
    process, containers on the host network), so the random part carries the
    uniqueness: 24 bits, as before, collided in about 3% of 1024-handler rounds."""
    # os.urandom is what secrets.token_hex reads: the same bits, without that import.
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(6).hex()}"


def repeated_ids(joined: list[dict[str, Any]]) -> list[str]:
    """Node ids that more than one of ``joined`` (join records) carry."""
    counts = Counter(str(r["id"]) for r in joined)
    return sorted(node_id for node_id, n in counts.items() if n > 1)


def hb_key(node_id: str) -> str:
    return f"hb/{node_id}"


def count_key(rnd: int) -> str:
    return f"r/{rnd}/count"


def join_key(rnd: int, slot: int) -> str:
    return f"r/{rnd}/join/{slot}"


def assignment_key(rnd: int) -> str:
    return f"r/{rnd}/assignment"


def roster_key(rnd: int) -> str:
    return f"r/{rnd}/roster"


def lost_key(rnd: int) -> str:
    return f"r/{rnd}/lost"


def progress_key(rnd: int) -> str:
    return f"r/{rnd}/progress"


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def loads(raw: bytes, key: str) -> Any:
    """Parse a JSON value read from ``key`` (full key name, for the error message)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json parses
        raise RendezvousStateError(
            f"rendezvous state key {key!r} does not hold JSON: {bytes(raw[:60])!r}"
        ) from None


def counter(raw: bytes, key: str) -> int:
    """A counter's value as ``multi_get`` read it (``b""``: never added to, 0)."""
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise RendezvousStateError(
            f"rendezvous state key {key!r} is not a counter: {bytes(raw[:60])!r}"
        ) from None


# What a reader writes, with ``compare_set`` from absent, at a join slot that is still
# empty a short while after it was taken (``Joiner.read_slots``): its taker died between
# the ``add`` and its record, or is slow and finds the claim and takes another slot.
EMPTY_SLOT = dumps({"empty": True})


def is_empty_slot(record: Any) -> bool:
    return isinstance(record, dict) and record.get("empty") is True


def valid_join(record: Any, rnd: int) -> bool:
    """The shape every join record has; anything else is ignored as foreign."""
    return (
        isinstance(record, dict)
        and isinstance(record.get("id"), str)
        and isinstance(record.get("addr"), str)
        and isinstance(record.get("port"), int)
        and record.get("round") == rnd
    )


STATES = ("formed", "abandoned", "closed")
SUCCESSORS = 16  # standbys an outcome names, in rank order (where the job's store may move)


@dataclass
class Assignment:
    """One round's published outcome, as every node reads it. A formed round names rank
    0 (``first``) and the world size, not every member (that is the ``Roster``): a
    node finds its rank from its join slot in ``ranks``, runs of ``[first slot, its
    rank, count]`` (one run when the ranks follow the slots, as in a first round)."""

    round: int
    state: str  # "formed", "abandoned" (re-join the next round) or "closed"
    size: int = 0  # nodes in the round
    first: str = ""  # rank 0's node id
    ranks: list[list[int]] = field(default_factory=list)
    master_addr: str = ""
    master_port: int = 0
    formed_at: float = 0.0
    coordinator: str = ""
    fingerprint: dict[str, str] = field(default_factory=dict)  # rank 0's: the job's
    min_nodes: int = 0  # the coordinator's settings, for ``elastic status``
    max_nodes: int = 0
    presence_port: int = 0  # rank 0's presence port (presence.py) at master_addr; 0: none
    # Rank 1, the deputy: a second presence port, so a death is seen after rank 0 left.
    deputy: str = ""  # its node id; "": none (a round of one)
    deputy_addr: str = ""
    deputy_port: int = 0
    # Where the job's store may move (c10d's handover): the first ``SUCCESSORS`` members'
    # standby stores, "host:port", in rank order.
    successors: list[str] = field(default_factory=list)
    change: MembershipChange | None = None  # since the job's last round; None: its first
    # Joiners left for the next round so that kept workers train first (``kept_first``).
    deferred: int = 0

    def rank_of(self, slot: int) -> int | None:
        """The node rank of whoever joined this round at ``slot``; None: not a member."""
        for run in self.ranks:
            if len(run) == 3 and run[0] <= slot < run[0] + run[2]:
                rank = run[1] + slot - run[0]
                return rank if 0 <= rank < self.size else None
        return None

    def to_json(self) -> str:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes, key: str, rnd: int) -> Assignment:
        """Round ``rnd``'s assignment, read from ``key``; one that names another round
        or state is not this round's outcome (a copy from elsewhere)."""
        record = loads(raw, key)
        try:
            if not isinstance(record, dict):
                raise TypeError
            asg = cls(**_known(cls, record))
            if asg.change is not None:
                change = asg.change = MembershipChange(**_known(MembershipChange, asg.change))
                if not (_strings(change.left) and _strings(change.came)):
                    raise TypeError
                if not _ints([change.left_count, change.came_count]):
                    raise TypeError
            runs_ok = isinstance(asg.ranks, list) and all(
                isinstance(run, list) and _ints(run) for run in asg.ranks
            )
            if not (runs_ok and _ints([asg.size, asg.deferred]) and isinstance(asg.first, str)):
                raise TypeError
        except (TypeError, AttributeError):
            raise RendezvousStateError(
                f"rendezvous state key {key!r} is not an assignment: {bytes(raw[:60])!r}"
            ) from None
        if asg.round != rnd or asg.state not in STATES:
            raise RendezvousStateError(
                f"rendezvous state key {key!r} holds round {asg.round!r}'s outcome "
                f"{asg.state!r}, not one of round {rnd}"
            )
        return asg


@dataclass
class Roster:
    """A formed round's members, by node rank (``r/<n>/roster``)."""

    round: int
    members: list[str] = field(default_factory=list)  # node ids
    hosts: list[str] = field(default_factory=list)  # their hostnames
    # Where each member keeps a store ready to take over the job's (c10d's handover,
    # "host:port"), "" for none.
    standbys: list[str] = field(default_factory=list)
    # Where each member's presence port listens ("addr:port", "" for none): a serving rank
    # asks one that never connected whether its process is still there (presence.py).
    presence: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes, key: str, rnd: int) -> Roster:
        record = loads(raw, key)
        try:
            if not isinstance(record, dict):
                raise TypeError
            roster = cls(**_known(cls, record))
        except TypeError:
            raise RendezvousStateError(
                f"rendezvous state key {key!r} is not a roster: {bytes(raw[:60])!r}"
            ) from None
        lists = (roster.members, roster.hosts, roster.standbys, roster.presence)
        if roster.round != rnd or not all(_strings(x) for x in lists):
            raise RendezvousStateError(
                f"rendezvous state key {key!r} holds no roster of round {rnd}: {bytes(raw[:60])!r}"
            )
        return roster


def _known(cls: type, record: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``record`` that ``cls`` has (a newer version's extra ones are ignored)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in record.items() if k in names}


def _ints(values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _strings(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, str) for v in values)


def rank_runs(slots: list[int]) -> list[list[int]]:
    """``Assignment.ranks`` for members whose join slots, by node rank, are ``slots``."""
    runs: list[list[int]] = []
    for slot, rank in sorted((slot, rank) for rank, slot in enumerate(slots)):
        last = runs[-1] if runs else None
        if last is not None and slot == last[0] + last[2] and rank == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([slot, rank, 1])
    return runs


def kept_first(
    records: list[dict[str, Any]], min_nodes: int, prev_round: int, prev_members: list[str]
) -> list[dict[str, Any]]:
    """The join records a round is formed with: all of them, except after a loss.

    Kept workers (``kept``: their nodes regroup in place) whose group is broken cannot
    train until this round gives them a new one: they say so (``waiting``: it lost a
    member), or a member of their round (``workers_round``, the last one, ``prev_round``)
    comes back with workers to start, its old ones gone (fenced while cut off, crashed),
    which a kept worker blocked in a collective with them may not have noticed. A joiner
    with workers still to start (``import torch``, the model: seconds) would hold them
    for its start-up. So the round is the kept nodes alone when they are enough for one
    (``min_nodes``); the others join the next round as any joiner joins a running job,
    while the kept workers train (their agents see them waiting). Fewer kept nodes than
    that wait for new workers either way, and kept workers whose group is whole train on
    in it meanwhile: then everyone forms one round."""
    kept: dict[str, dict[str, Any]] = {}
    for rec in records:
        if rec.get("kept") is True:
            kept.setdefault(rec["id"], rec)
    if len(kept) < min_nodes or all(rec["id"] in kept for rec in records):
        return records
    members = set(prev_members)
    broken = any(rec.get("waiting") is True for rec in kept.values()) or (
        any(rec.get("workers_round") == prev_round for rec in kept.values())
        and any(rec["id"] in members for rec in records if rec["id"] not in kept)
    )
    return [rec for rec in records if rec["id"] in kept] if broken else records


def choose_members(
    records: list[dict[str, Any]], prev_members: list[str], max_nodes: int
) -> list[dict[str, Any]]:
    """Pick and order this round's members; the result is indexed by node rank.

    Members of the previous round come first, in their old rank order, so the same
    membership gets the same ranks and a full job keeps its nodes over newcomers; then
    newcomers by arrival. ``rank_hint`` (``--node-rank``) wins where it is free and fits.
    """
    prev_rank = {node: rank for rank, node in enumerate(prev_members)}
    unique: dict[str, dict[str, Any]] = {}
    for rec in records:  # a node joins once per round; keep its first record
        unique.setdefault(rec["id"], rec)
    ordered = sorted(
        enumerate(unique.values()),
        key=lambda item: (item[1]["id"] not in prev_rank, prev_rank.get(item[1]["id"], 0), item[0]),
    )
    chosen = [rec for _, rec in ordered][:max_nodes]
    slots: list[dict[str, Any] | None] = [None] * len(chosen)
    rest: list[dict[str, Any]] = []
    for rec in chosen:
        hint = rec.get("rank_hint")
        if isinstance(hint, int) and 0 <= hint < len(slots) and slots[hint] is None:
            slots[hint] = rec
        else:
            rest.append(rec)
    it = iter(rest)
    return [slot if slot is not None else next(it) for slot in slots]
