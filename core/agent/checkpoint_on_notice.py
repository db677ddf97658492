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

The control file (``elastic.core.workers.control_file``) carries the request to the
workers; the worker side is ``elastic.training.preemption``. This module runs in the
agent and never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence

from elastic.core.interfaces.job_keys import PREEMPT_KEY
from elastic.core.interfaces.rendezvous import RendezvousError
from elastic.core.interfaces.store import Store
from elastic.core.log import say
from elastic.core.workers.control_file import (
    ENV_PREEMPTION_GRACE,
    ENV_PREEMPTION_SIGNAL,
    ControlFile,
)
from elastic.core.workers.process import WorkerProcess

DEFAULT_GRACE = 25.0


def notice_env(signal_name: str, grace: float, handled: Sequence[str]) -> dict[str, str]:
    """What tells the workers which signal is a notice the agent coordinates a save on:
    a whole SLURM step gets it at once, workers included, and a listening worker then
    defers it into a checkpoint request (``elastic.training.preemption``)."""
    if grace <= 0 or signal_name not in handled:
        return {}
    return {ENV_PREEMPTION_SIGNAL: signal_name, ENV_PREEMPTION_GRACE: f"{grace:g}"}


def saved_key(round_: int) -> str:
    return PREEMPT_KEY.format(round_) + "/saved"


def noticed_key(round_: int) -> str:
    """How many nodes got the notice themselves: all of them when a whole SLURM step is
    preempted, cancelled or timed out."""
    return PREEMPT_KEY.format(round_) + "/noticed"


def seen_key(round_: int) -> str:
    """How many noticed nodes saw the save complete (and may go)."""
    return PREEMPT_KEY.format(round_) + "/seen"


class Coordinator:
    """One agent's part in a round's coordinated checkpoint (any agent: the departing
    one and the others alike). ``number`` identifies the request in control files."""

    def __init__(self, store: Store, round_: int, control: ControlFile) -> None:
        self.store = store
        self.round = round_
        self.control = control
        self.number = round_ + 1  # unique per round; 0 means "no request"
        self._counted = False
        self._seen = False

    def announce(self, who: dict[str, object]) -> None:
        """Publish the request; the first notice of the round wins, later ones join it."""
        self.store.compare_set(PREEMPT_KEY.format(self.round), "", json.dumps(who))
        self.store.add(noticed_key(self.round), 1)

    def relay(self) -> bool:
        """Raise the request locally; count this node once all its workers saved.
        Whether it is counted."""
        self.control.request(self.number)
        if not self._counted and self.control.all_saved(self.number):
            self.store.add(saved_key(self.round), 1)
            self._counted = True
        return self._counted

    def saved_here(self) -> bool:
        """Every local worker saved for this round's request: they learn of it from
        their peers' all_reduce, before this agent's next read of the job's keys does.
        A read of shared memory, free to ask every monitor interval."""
        return self.control.all_saved(self.number)

    @property
    def counted(self) -> bool:
        """This node's save is counted: only then can the round's save be complete."""
        return self._counted

    def complete(self, world_size: int) -> bool:
        """Every node of the round has saved."""
        return self._counted and int(self.store.add(saved_key(self.round), 0)) >= world_size

    def all_leaving_saw_it(self, world_size: int) -> bool:
        """Count this node as having seen the save complete; True unless every node got
        the notice (the whole job is leaving) and some have not seen it yet: the node
        serving the store must not take it away from them before they do."""
        if not self._seen:
            self.store.add(seen_key(self.round), 1)
            self._seen = True
        if int(self.store.add(noticed_key(self.round), 0)) < world_size:
            return True  # one node (or a few) leaving: the others go on with the job
        return int(self.store.add(seen_key(self.round), 0)) >= world_size


def count_if_saved(coordinator: Coordinator) -> None:
    """Count this node's save once its workers saved: for an agent that is not watching
    its round (it waits for the next one to get ready) while its workers train on in the
    old group, where a peer's all_reduce brings them a notice's request. Uncounted, the
    departing node would wait out its whole grace."""
    if coordinator.saved_here():
        coordinator.relay()


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
                break
            time.sleep(pause)
        else:
            return False
    except RendezvousError:
        return False
    # Complete: a store gone from now on (its node left once all saw it) changes nothing.
    with contextlib.suppress(RendezvousError):
        while not coordinator.all_leaving_saw_it(world_size) and time.monotonic() < deadline:
            time.sleep(pause)
    return True


def checkpoint_before_leaving(
    coordinator: Coordinator,
    signal_name: str,
    node_id: str,
    world_size: int,
    grace: float,
    workers: Sequence[WorkerProcess],
) -> None:
    """The departing agent's part: announce the notice, then wait (bounded by ``grace``)
    until every node saved, saying what happened in one line each. Only for scripts that
    use ``elastic.checkpoint_requested()``: the others would never save, so nobody waits
    for them."""
    if not workers or grace <= 0 or not coordinator.control.listening():
        return
    say(
        f"elastic: {signal_name}: preemption notice; the job checkpoints before this node "
        f"leaves (--preemption-grace {grace:g}s)"
    )
    try:
        coordinator.announce({"node": node_id, "host": socket.gethostname(), "at": time.time()})
    except RendezvousError:
        return

    def alive() -> bool:
        return all(w.poll() is None for w in workers)

    if wait_for_save(coordinator, world_size, grace, alive):
        say("elastic: the job's checkpoint is complete; leaving")
    else:
        say(
            "elastic: no complete checkpoint within the grace; leaving anyway (the job "
            "resumes from its last complete checkpoint)",
            logging.WARNING,
        )
