"""Preemption without lost work: a coordinated checkpoint on notice, then a clean departure.

Spot instances and preemptible VMs give notice (SIGTERM and ~30 s on most clouds, a pod's
grace period on Kubernetes). An agent that gets the notice (``--preemption-signal``,
SIGTERM by default) asks the whole job to checkpoint at its next step boundary and leaves
once the save is complete, or when ``--preemption-grace`` runs out, whichever is first:

1. It publishes ``agent/preempt/<round>`` with ``compare_set``: two notices at once make
   one request, so the job saves once.
2. Every agent (its ``JobWatch`` reads the key) raises the request in its node's control
   file; every worker sees it through ``elastic.checkpoint_requested()`` (a read of shared
   memory), the ranks agree with one all_reduce, save, and call
   ``elastic.checkpoint_saved()``, which marks the worker's slot and then waits for the
   agent to stop it (the job is about to re-form: no step runs past the checkpoint).
3. An agent whose workers have all saved adds one to ``agent/preempt/<round>/saved``; the
   departing agent leaves when that count reaches the round's size. The survivors see the
   departure at once, regroup without spending a restart, and resume from the checkpoint.

The control file is per node and per attempt: an 8-byte request number, then one slot per
local rank with (listening, saved) request numbers. "Listening" says the script uses the
API at all: a departing agent whose workers never asked does not wait for a save that will
not come. This module runs in the agent and never imports torch; the worker side is
``elastic.training.preemption``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable

from elastic.core.rendezvous import RendezvousError
from elastic.core.store import Store

ENV_CONTROL = "ELASTIC_CONTROL_FILE"
HEADER = struct.Struct("<Q")  # the request number; 0: none
SLOT = struct.Struct("<QQ")  # per local rank: (listening, saved request number)
# A worker may learn of a request from its peers (the all_reduce of the flag) before its
# own agent has raised it locally: it then saves "for whatever request is pending".
SAVED_PENDING = 2**64 - 1
PREEMPT_KEY = "agent/preempt/{}"  # one request per round, compare_set
DEFAULT_GRACE = 25.0


def slot_offset(local_rank: int) -> int:
    return HEADER.size + SLOT.size * local_rank


class ControlFile:
    """The agent's end of one attempt's control file (created zeroed, mapped shared)."""

    def __init__(self, local_world_size: int, directory: str | None = None) -> None:
        self.size = slot_offset(local_world_size)
        self.local_world_size = local_world_size
        fd, self.path = tempfile.mkstemp(prefix="elastic-control-", dir=directory)
        try:
            os.write(fd, bytes(self.size))
            self._map: mmap.mmap | None = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.requested = 0

    def worker_env(self) -> dict[str, str]:
        return {ENV_CONTROL: self.path}

    def request(self, number: int) -> None:
        """Ask every local worker to checkpoint (idempotent)."""
        if self._map is not None and number != self.requested:
            HEADER.pack_into(self._map, 0, number)
            self.requested = number

    def _slots(self) -> list[tuple[int, int]]:
        if self._map is None:
            return []
        return [SLOT.unpack_from(self._map, slot_offset(r)) for r in range(self.local_world_size)]

    def listening(self) -> bool:
        """Whether any local worker asked ``checkpoint_requested()`` at least once."""
        return any(listening for listening, _ in self._slots())

    def all_saved(self, number: int) -> bool:
        slots = self._slots()
        return bool(slots) and all(saved in (number, SAVED_PENDING) for _, saved in slots)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def saved_key(round_: int) -> str:
    return PREEMPT_KEY.format(round_) + "/saved"


class Coordinator:
    """One agent's part in a round's coordinated checkpoint (any agent: the departing
    one and the others alike). ``number`` identifies the request in control files."""

    def __init__(self, store: Store, round_: int, control: ControlFile) -> None:
        self.store = store
        self.round = round_
        self.control = control
        self.number = round_ + 1  # unique per round; 0 means "no request"
        self._counted = False

    def announce(self, who: dict[str, object]) -> None:
        """Publish the request; the first notice of the round wins, later ones join it."""
        self.store.compare_set(PREEMPT_KEY.format(self.round), "", json.dumps(who))

    def relay(self) -> None:
        """Raise the request locally; count this node once all its workers saved."""
        self.control.request(self.number)
        if not self._counted and self.control.all_saved(self.number):
            self.store.add(saved_key(self.round), 1)
            self._counted = True

    def complete(self, world_size: int) -> bool:
        """Every node of the round has saved."""
        return self._counted and int(self.store.add(saved_key(self.round), 0)) >= world_size


def wait_for_save(
    coordinator: Coordinator,
    world_size: int,
    grace: float,
    workers_alive: Callable[[], bool],
    pause: float = 0.05,
) -> bool:
    """Relay the request until the whole job saved (True) or the grace ran out, a worker
    ended, or the store stopped answering (False: leave anyway; the job resumes from its
    last complete checkpoint, which a checkpointer writes atomically)."""
    deadline = time.monotonic() + grace
    try:
        while time.monotonic() < deadline and workers_alive():
            coordinator.relay()
            if coordinator.complete(world_size):
                return True
            time.sleep(pause)
    except RendezvousError:
        return False
    return False


def checkpoint_before_leaving(
    coordinator: Coordinator,
    signal_name: str,
    node_id: str,
    world_size: int,
    grace: float,
    workers_alive: Callable[[], bool],
) -> None:
    """The departing agent's part: announce the notice, then wait (bounded by ``grace``)
    until every node saved, saying what happened in one line each."""
    print(
        f"elastic: {signal_name}: preemption notice; the job checkpoints before this node "
        f"leaves (--preemption-grace {grace:g}s)",
        file=sys.stderr,
        flush=True,
    )
    try:
        coordinator.announce({"node": node_id, "host": socket.gethostname(), "at": time.time()})
    except RendezvousError:
        return
    if wait_for_save(coordinator, world_size, grace, workers_alive):
        print("elastic: the job's checkpoint is complete; leaving", file=sys.stderr, flush=True)
    else:
        print(
            "elastic: no complete checkpoint within the grace; leaving anyway (the job "
            "resumes from its last complete checkpoint)",
            file=sys.stderr,
            flush=True,
        )
