"""Waits of a regrouping worker that end once its agent has moved on to a newer round.

A kept worker waits for its peers in the step agreement and the state sync's gathers
(``elastic.train``) and, in a new round, in the creation of its process group. A peer
gone without closing its connections (its host killed with its network, its cable cut)
leaves such a wait to gloo's timeout (minutes), far past the agent's bound for taking
its next round (``BOUNDARY_WAIT`` in ``core/agent/regroup.py``): the agent then stops the
worker and restarts it, and the state kept in place is lost. A thread cannot free the
main thread from a C++ wait, so the main thread never enters one without a bound:

- ``wait_work`` waits for a collective's work in short slices;
- ``meet`` gathers the ranks of a new round in Python (through the round's store)
  before the kept ones enter gloo's full-mesh connect, which waits for every rank;

and each gives up (``RoundMoved``) once the agent has handed over a round newer than the
one this worker runs in and ``GIVE_UP_AFTER`` s (plus the worker's last step) have passed
since: a live peer reaches its step boundary within that, and the agent waits longer. When
the agent says this worker's round lost a member (``LOST_FIELD``: a node left, died or was
cut off), the wait cannot end well and is given up at once, before the next round forms:
a cut-off peer then costs its detection, not that plus the grace.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

from elastic.core.workers.control_file import GENERATION_FIELD, JOINED, LOST_FIELD, STEP_US
from elastic.training import control
from elastic.training.heartbeat import WaitBeat

# s a wait goes on once a newer round is handed over, plus this worker's last step: less
# than the agent's bound for taking a round (5 s plus twice the longest step).
GIVE_UP_AFTER = 2.0
_SLICE = datetime.timedelta(milliseconds=50)
_POLL = 0.005
# s one store call of ``meet`` may take (its host may be cut off)
_STORE_CALL = datetime.timedelta(seconds=2)
MEET_KEY = "elastic/meet"
# s kept workers wait for ranks that never count themselves in at ``MEET_KEY`` (a joiner
# whose script makes its group with torch's own init) before they go on to gloo's connect
MEET_PATIENCE = 30.0
# works of the current group given up on (``dist.leave_group`` parks them with the group)
abandoned: list[Any] = []


class RoundMoved(RuntimeError):
    """A wait was given up: the agent handed over a newer round meanwhile (a peer of this
    one is gone). The caller goes on to that round as after a broken collective."""


class Watch:
    """Whether this wait should end: our round lost a member, or a round newer than ours
    has been handed over for ``GIVE_UP_AFTER`` s plus our last step, counted from the
    first time this watch saw it."""

    def __init__(self) -> None:
        self._since: float | None = None

    def moved(self) -> bool:
        joined = control.mine(JOINED)
        if control.header(LOST_FIELD) > joined:
            return True  # a member of our round is gone: nothing to wait for
        if control.header(GENERATION_FIELD) <= joined:
            self._since = None
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
        return now - self._since > GIVE_UP_AFTER + control.mine(STEP_US) / 1e6


def wait_work(work: Any, what: str) -> None:
    """Wait for a collective's ``work``; its error when it failed, ``RoundMoved`` when
    the agent moved on while it waited (the work is left in ``abandoned``)."""
    if not control.available():
        work.wait()
        return
    watch = Watch()
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # it ended since: its own outcome (a failure raises)
                work.wait()
                return
        if watch.moved():
            abandoned.append(work)
            raise RoundMoved(f"{what} given up: the agent handed over a newer round")


def meet(*, limit: float) -> Any:
    """Count this rank in at the round's store (``MEET_KEY``) and wait in Python until
    every rank of the round did; ``RoundMoved`` when the agent moves on meanwhile (a rank
    of this round is gone). Kept workers (``rejoin_group``) and new ones
    (``elastic.init_process_group``) alike: a new one waiting here still takes a newer
    round, where one blocked in gloo's connect would be restarted. A rank that makes its
    group with torch's own init never counts: after ``MEET_PATIENCE`` s the others go on
    to gloo's connect all the same.

    Returns the store when this rank hosts it (rank 0, unless the agent's store serves the
    workers): ``multi_tenant``, so torch's own creation of the group reuses its server;
    keep it until then. None on other ranks, or when the store did not come up within
    ``limit`` s (torch's creation then says what is wrong)."""
    from torch.distributed import TCPStore

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    watch = Watch()
    deadline = time.monotonic() + limit
    if not hosting and not _wait_for_port(addr, port, watch, deadline):
        return None
    store = _until(
        watch,
        lambda: TCPStore(
            addr,
            port,
            world_size,
            is_master=hosting,
            timeout=_STORE_CALL,
            wait_for_workers=False,
            multi_tenant=True,
        ),
    )
    _until(watch, lambda: store.add(MEET_KEY, 1))
    patience = time.monotonic() + MEET_PATIENCE
    beat = WaitBeat()
    while _until(watch, lambda: store.add(MEET_KEY, 0)) < world_size:
        if watch.moved():
            raise RoundMoved("the round's ranks did not meet: a newer round came")
        if time.monotonic() >= patience:
            break
        beat()
        time.sleep(_POLL)
    return store if hosting else None


def _until(watch: Watch, call: Any) -> Any:
    """``call()`` retried while it fails (the store's host is slow or cut off) until the
    agent moved on."""
    while True:
        try:
            return call()
        except (RuntimeError, OSError):  # torch's DistStoreError is a RuntimeError
            if watch.moved():
                raise RoundMoved("the round's ranks did not meet: a newer round came") from None
            time.sleep(_POLL)


def _wait_for_port(addr: str, port: int, watch: Watch, deadline: float) -> bool:
    """Until rank 0's store listens at ``addr:port`` (True), or ``deadline`` (False).
    Every rank learns a new round at about the same moment; a client whose connection is
    refused backs off (torch's TCPStore: hundreds of ms) although the store comes up a
    few ms later: polling the port first takes that back-off out of a regroup."""
    beat = WaitBeat()
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return True
        except OSError:
            if watch.moved():
                raise RoundMoved("the round's store did not come up: a newer round came") from None
        beat()
        time.sleep(_POLL)
    return False
