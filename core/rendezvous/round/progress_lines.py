"""Lines that tell a person what the rendezvous is doing, on the agent's stderr.

While a round forms, a node prints one line a few seconds in and then every ``EVERY``
seconds (a round that forms fast prints nothing)::

    elastic: waiting for nodes: 2 joined, need 4 (max 4); missing node1, node3 (from the
    last round); join_timeout in 583s

The coordinator knows who joined (it reads the join records anyway); it writes a small
``r/<n>/progress`` record when that changes (only after ``PUBLISH_AFTER`` seconds, so a
fast round writes nothing), and every other node reads that one record per line: O(1)
store operations per line per node. "Missing" are the members of the last formed round
that have not joined this one, named by hostname (by node id where two share a host).

Once a round forms, the agent prints one line when something changed (``round_line``)::

    elastic: round 3 formed: 3 nodes (was 4); left: node2; came: -; this node is rank 1

Every line is written whole with one ``write`` and a flush, and only while this node's
workers are stopped (during a rendezvous, or before the new round's workers start), so
it never lands in the middle of a worker's line.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any, NamedTuple

from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.rendezvous import (
    MembershipChange,
    RendezvousError,
    RendezvousInfo,
)
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.log import say
from elastic.core.rendezvous.round import records as R

log = logging.getLogger(__name__)

Say = Callable[[str], None]  # receives one whole line, without its newline

FIRST_LINE = 2.0  # s before the first waiting line: a fast round prints nothing
EVERY = 5.0  # s between waiting lines
PUBLISH_AFTER = 1.5  # s before the coordinator writes its first progress record
MAX_NAMES = 8  # names shown (and published) at most; the rest are counted


def say_stderr(line: str) -> None:
    """One whole line to the ``elastic`` logger (on stderr with one write, then a flush,
    through the CLI's handler: ``core/log.py``)."""
    say(line)


def labels(ids: Sequence[str], hosts: Mapping[str, str]) -> dict[str, str]:
    """A name per node id: its hostname, or the node id itself where two of ``ids``
    share a hostname (several agents on one machine) or the host is unknown."""
    names = [hosts.get(node, "") for node in ids]
    return {
        node: name if name and names.count(name) == 1 else node
        for node, name in zip(ids, names, strict=True)
    }


def name_list(names: Sequence[str], total: int | None = None) -> str:
    """``a, b, c``; past ``MAX_NAMES`` (or when ``total`` says more exist) ``... and N more``."""
    total = len(names) if total is None else total
    if total == 0:
        return "-"
    shown = list(names[:MAX_NAMES])
    more = total - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


class Forming(NamedTuple):  # a named tuple: see AttemptEnd in core/agent/outcome.py
    """What the coordinator publishes about the round it forms (``r/<n>/progress``)."""

    joined: int
    min_nodes: int
    max_nodes: int
    missing: tuple[str, ...] | None = None  # names, at most MAX_NAMES; None: no last round
    missing_count: int = 0

    def to_json(self) -> str:
        return R.dumps(
            {
                "joined": self.joined,
                "min": self.min_nodes,
                "max": self.max_nodes,
                "missing": None if self.missing is None else list(self.missing),
                "missing_count": self.missing_count,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> Forming | None:
        try:
            rec: Any = json.loads(raw)
            missing = rec["missing"]
            return cls(
                joined=int(rec["joined"]),
                min_nodes=int(rec["min"]),
                max_nodes=int(rec["max"]),
                missing=None if missing is None else tuple(str(m) for m in missing),
                missing_count=int(rec["missing_count"]),
            )
        except (ValueError, TypeError, KeyError, RecursionError):
            return None  # a line is not worth an error: say less instead

    def line(self, timeout_in: float) -> str:
        if self.joined < self.min_nodes:
            head = f"{self.joined} joined, need {self.min_nodes} (max {self.max_nodes})"
        else:
            head = (
                f"{self.joined} joined (min {self.min_nodes} reached, max {self.max_nodes}), "
                "last call for more"
            )
        parts = [f"elastic: waiting for nodes: {head}"]
        if self.missing:
            parts.append(
                f"missing {name_list(self.missing, self.missing_count)} (from the last round)"
            )
        parts.append(f"join_timeout in {max(0, round(timeout_in))}s")
        return "; ".join(parts)


class RoundProgress:
    """The waiting lines of one ``next_round`` call (a round, or several if one is
    abandoned): a clock for when a line is due, and what each role says."""

    def __init__(self, say: Say, min_nodes: int, max_nodes: int, deadline: float) -> None:
        self.say = say
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.deadline = deadline
        self.started = time.monotonic()
        self._next_line = self.started + FIRST_LINE
        self._published: tuple[int, frozenset[str], frozenset[str]] | None = None

    def until_due(self) -> float:
        """Seconds until the next line is due (0 when it is)."""
        return max(0.0, self._next_line - time.monotonic())

    def _due(self) -> bool:
        now = time.monotonic()
        if now < self._next_line:
            return False
        self._next_line = now + EVERY
        return True

    def _timeout_in(self) -> float:
        return self.deadline - time.monotonic()

    def coordinating(
        self,
        store: CoordinationStore,
        rnd: int,
        joined: Sequence[Mapping[str, Any]],
        prev: R.Roster | None,
        expected: Set[str] = frozenset(),
    ) -> None:
        """The coordinator, each poll: publish who joined when it changed (after the
        first ``PUBLISH_AFTER`` s), say a line when one is due. No store read. Missing
        are the members of ``prev`` still ``expected`` (not known to have left)."""
        ids = frozenset(str(rec["id"]) for rec in joined)
        now = time.monotonic()
        state = (rnd, ids, frozenset(expected))
        publish = now - self.started >= PUBLISH_AFTER and state != self._published
        if not publish and now < self._next_line:
            return
        missing: tuple[str, ...] | None = None
        count = 0
        if prev is not None:
            names = labels(prev.members, dict(zip(prev.members, prev.hosts, strict=False)))
            gone = [names[m] for m in prev.members if m in expected and m not in ids]
            missing, count = tuple(gone[:MAX_NAMES]), len(gone)
        forming = Forming(len(ids), self.min_nodes, self.max_nodes, missing, count)
        if publish:
            store.set(R.progress_key(rnd), forming.to_json())
            self._published = state
        if self._due():
            self.say(forming.line(self._timeout_in()))

    def waiting(self, store: CoordinationStore, rnd: int) -> None:
        """A node waiting for the coordinator: when a line is due, read the
        coordinator's record (a ``check`` and a ``get``) and say it."""
        if not self._due():
            return
        forming = None
        key = R.progress_key(rnd)
        try:
            if store.check([key]):
                forming = Forming.from_json(store.get(key))
        except (RendezvousError, StoreTimeoutError) as exc:
            log.debug("cannot read %s: %s", key, exc)
        if forming is not None:
            self.say(forming.line(self._timeout_in()))
        else:
            self.say(
                f"elastic: waiting for round {rnd} to form (its coordinator has not reported "
                f"yet); join_timeout in {max(0, round(self._timeout_in()))}s"
            )

    def standby(self) -> None:
        """A node that found the job full (``max_nodes``)."""
        if self._due():
            self.say(
                f"elastic: waiting for room: the job is full (max {self.max_nodes} nodes); "
                "this node joins when the job next re-forms; join_timeout in "
                f"{max(0, round(self._timeout_in()))}s"
            )


def membership_change(prev: R.Roster | None, roster: R.Roster) -> MembershipChange | None:
    """Who left and who came from ``prev`` (the job's last round; None: this is its
    first) to ``roster``, named for ``round_line`` (hostnames, node ids where needed)."""
    if prev is None:
        return None
    old, new = set(prev.members), set(roster.members)
    left = [m for m in prev.members if m not in new]
    came = [m for m in roster.members if m not in old]
    hosts = dict(zip(prev.members, prev.hosts, strict=False))
    hosts.update(zip(roster.members, roster.hosts, strict=False))
    names = labels(list(dict.fromkeys([*prev.members, *roster.members])), hosts)
    return MembershipChange(
        left=[names[m] for m in left[:MAX_NAMES]],
        came=[names[m] for m in came[:MAX_NAMES]],
        left_count=len(left),
        came_count=len(came),
    )


def round_line(prev: RendezvousInfo | None, info: RendezvousInfo) -> str | None:
    """The line for a round that just formed, or None when it says nothing new: a
    single node (standalone) whose round is the same one node as before."""
    size, rank = info.world_size, info.rank
    where = f"this node is rank {rank}"
    head = f"elastic: round {info.round} formed: {size} node{'s' if size != 1 else ''}"
    if prev is None:
        return None if size <= 1 else f"{head}; {where}"
    change = info.change
    if change is None and prev.members and info.members:  # a backend that lists members
        change = membership_change(
            R.Roster(0, prev.members, prev.hosts), R.Roster(0, info.members, info.hosts)
        )
    if change is None:  # a backend that does not name its members
        if size == prev.world_size:
            return None if size <= 1 else f"{head}; {where}"
        return f"{head} (was {prev.world_size}); {where}"
    if not change.left_count and not change.came_count:
        return None if size <= 1 else f"{head} (the same nodes); {where}"
    return (
        f"{head} (was {prev.world_size}); left: {name_list(change.left, change.left_count)}; "
        f"came: {name_list(change.came, change.came_count)}; {where}"
    )
