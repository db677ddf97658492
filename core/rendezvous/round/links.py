"""This node's presence connections to its round's serving ranks (``presence.py``).

A member connects to rank 0's presence port the instant its round forms, from the
thread that returns the round (not a tick later: a member killed in its round's first
second is seen). When rank 0 is gone (it said goodbye on leaving, or its port refuses
us after its connection closed) and the job re-forms without it, the member connects to
rank 1's, the deputy, which listens on through the regroup: a member that dies then is
still found by a closed connection, not after ``heartbeat_timeout``. In a running round
nobody connects to the deputy, so a round costs one connection per member. A serving
rank's ``news`` on a connection wakes the monitor for a tick at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.presence_client import PresenceClient


def _nothing() -> None:
    """What a member does when the deputy says goodbye: nothing (it published that)."""


class PresenceLinks:
    """This node's presence connections (``connect``, which never blocks): to
    rank 0 from the round's first instant, to rank 1 (the deputy) once rank 0 is gone;
    and the serving ranks they found dead. ``hello``: our answer to a challenge, given
    the round and the challenge (``presence.hello_line``); ``wake``: connect or publish
    now (called on a client's thread)."""

    def __init__(self, hello: Callable[[int, str], bytes] | None, wake: Callable[[], None]) -> None:
        self.hello = hello
        self._wake = wake
        self._lock = threading.Lock()
        self._asg: R.Assignment | None = None  # the round whose serving ranks we watch
        self._mine: tuple[R.Assignment, int] | None = None  # and our rank in it
        self._plan: tuple[R.Assignment, int] | None = None  # rank 0's, to connect to
        self._deputy_plan: tuple[R.Assignment, int] | None = None  # the deputy's
        self.client: PresenceClient | None = None  # to rank 0
        self.deputy_client: PresenceClient | None = None  # to rank 1
        self._gone: set[str] = set()  # found dead (a serving rank, or carried over)

    def follow(
        self, asg: R.Assignment | None, rank: int | None, keep: bool
    ) -> list[PresenceClient]:
        """Round ``asg`` (our ``rank`` in it) is ours now: connect to its rank 0 on the
        next ``connect``. ``keep`` (no round, a regroup): the last round's connections
        hold. Returns the connections dropped, for the caller to stop once out of its
        own lock."""
        with self._lock:
            self._plan = (asg, rank) if asg is not None and rank is not None else None
            self._deputy_plan = None
            if asg is None and keep:
                return []
            old = [c for c in (self.client, self.deputy_client) if c is not None]
            self.client = self.deputy_client = None
            self._asg, self._mine = asg, self._plan
            return old

    def connect(self, deputy: bool = True) -> None:
        """Open the connections asked for (never blocks: the process's presence thread
        connects them). ``deputy`` False: the job is closed (finished), it re-forms no more,
        so a rank 0 that said goodbye leaves nothing to watch: no deputy connection (a
        thousand members of a finished job would otherwise each open one as they exit)."""
        with self._lock:
            plans = [(self._plan, 0), (self._deputy_plan if deputy else None, 1)]
            self._plan = self._deputy_plan = None
        for plan, serving in plans:
            made = None if plan is None else self._client(*plan, serving)
            if made is None:
                continue
            with self._lock:
                if plan is not None and plan[0] is self._asg:
                    if serving == 0 and self.client is None:
                        self.client = made
                        continue
                    if serving == 1 and self.deputy_client is None:
                        self.deputy_client = made
                        continue
            made.stop()  # the round changed meanwhile

    def _client(self, asg: R.Assignment, rank: int, serving: int) -> PresenceClient | None:
        """A connection to ``asg``'s rank ``serving``; None: none to make (ourselves, a
        round of one, an older coordinator's outcome, no hello)."""
        if serving == 0:
            addr, port, node = asg.master_addr, asg.presence_port, asg.first
        else:
            addr, port, node = asg.deputy_addr, asg.deputy_port, asg.deputy
        valid = isinstance(addr, str) and isinstance(port, int) and 0 < port < 65536
        if rank == serving or not valid or not isinstance(node, str) or self.hello is None:
            return None
        bye = partial(self._to_deputy, asg) if serving == 0 else _nothing
        hello = partial(self.hello, asg.round)
        return PresenceClient(addr, port, hello, partial(self._died, asg, node), bye, self._wake)

    def _to_deputy(self, asg: R.Assignment) -> None:
        """Rank 0 of ``asg`` is gone: connect to its deputy, which listens on while the
        job re-forms without it (a member that dies then is still seen at once)."""
        with self._lock:
            if asg is not self._asg or self.deputy_client is not None:
                return
            self._deputy_plan = self._mine
        self._wake()

    def say_beat(self, value: bytes) -> None:
        """Our keep-alive writing ``value`` was acknowledged: say so to rank 0, which
        watches our heartbeat (the deputy does not)."""
        with self._lock:
            client = self.client
        if client is not None:
            client.say_beat(value)

    def rank0_beat(self) -> tuple[bytes, float] | None:
        """Rank 0's last ``beat`` word to us: (the heartbeat value, when it arrived)."""
        with self._lock:
            client = self.client
        return client.beat if client is not None else None

    def stop(self, leaving: bool = False) -> None:
        """Close our connections, saying goodbye; ``leaving``: for a departure this node
        published (the serving rank reads the round's facts at once)."""
        with self._lock:
            clients = [self.client, self.deputy_client]
            self.client = self.deputy_client = None
        for client in clients:
            if client is not None:
                client.stop(leaving)

    def gone(self) -> set[str]:
        with self._lock:
            return set(self._gone)

    def forget(self) -> None:
        """A new round (not a regroup): deaths seen before it no longer count."""
        with self._lock:
            self._gone = set()

    def add_gone(self, asg: R.Assignment, nodes: list[str]) -> bool:
        """``nodes`` died; counted (True) only while ``asg`` is still the round followed."""
        with self._lock:
            self._gone.update(nodes if asg is self._asg else [])
            return asg is self._asg

    def _died(self, asg: R.Assignment, node: str) -> None:
        """Our connection to ``node`` (a serving rank) closed and its port refuses us."""
        if self.add_gone(asg, [node]):
            self._wake()
        if node == asg.first:
            self._to_deputy(asg)
