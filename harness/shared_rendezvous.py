"""Several agents in one process sharing one job store: a real in-memory rendezvous
(``SharedRendezvous``) and the handler each agent holds of it (``NodeHandler``), for
tests of what agents decide together (one restart per round, a job-wide budget, exit
codes) without a network."""

from __future__ import annotations

import itertools
import threading

from elastic.core.interfaces.rendezvous import RendezvousClosedError, RendezvousInfo
from elastic.core.rendezvous.local import LocalRendezvousHandler


class SharedRendezvous:
    """A real in-memory rendezvous for ``n`` agents in one process (one per thread)."""

    def __init__(self, n: int) -> None:
        from elastic.core.interfaces.store import LocalStore

        self.n = n
        self.store = LocalStore()
        self.cond = threading.Condition()
        self.open_round = 0
        self.waiting: list[str] = []
        self.formed: dict[int, list[str]] = {}
        self.closed = False
        self.beats = itertools.count()  # every agent runs while the process does


class NodeHandler(LocalRendezvousHandler):
    def __init__(self, shared: SharedRendezvous, name: str) -> None:
        super().__init__("multi")
        self.shared, self.name = shared, name

    def next_rendezvous(self) -> RendezvousInfo:
        from elastic.core.rendezvous.local import free_port

        s = self.shared
        with s.cond:
            if s.closed:
                raise RendezvousClosedError("closed")
            rnd = s.open_round
            s.waiting.append(self.name)
            if len(s.waiting) == s.n:
                s.formed[rnd], s.waiting = sorted(s.waiting), []
                s.open_round += 1
                s.cond.notify_all()
            elif not s.cond.wait_for(lambda: s.open_round > rnd or s.closed, timeout=30):
                raise RendezvousClosedError("timed out")
            if s.closed and rnd not in s.formed:
                raise RendezvousClosedError("closed")
            members = s.formed[rnd]
        return RendezvousInfo(
            store=s.store,
            rank=members.index(self.name),
            world_size=s.n,
            master_addr="localhost",
            master_port=free_port(),
            round=rnd,
            members=members,
        )

    def round_peers(self) -> list[str] | None:
        """The other members of the last round."""
        s = self.shared
        with s.cond:
            members = s.formed[max(s.formed)] if s.formed else []
            return [m for m in members if m != self.name]

    def peer_heartbeats(self) -> dict[str, bytes | None] | None:
        """The other members of the last round, each with a fresh beat: agents that are
        threads of this process are alive while it runs."""
        s = self.shared
        with s.cond:
            return {m: str(next(s.beats)).encode() for m in self.round_peers() or []}

    def num_nodes_waiting(self) -> int:
        with self.shared.cond:
            return len(self.shared.waiting)

    def set_closed(self) -> None:
        with self.shared.cond:
            self.shared.closed = True
            self.shared.cond.notify_all()

    def is_closed(self) -> bool:
        return self.shared.closed
