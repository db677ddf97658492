"""Regrouping in place: the agent keeps its workers through a membership change.

A node leaving (preempted, gone) or joining, or another node's workers failing, re-forms
the job in a new round. Workers that said they can regroup (a "capable" mark in their
control-file slot: ``elastic.train``, ``elastic.membership_changed()``) need no restart
for it: the agent raises a regroup request in the control file (the ranks agree in their
per-step all_reduce to stop at one step boundary), joins the next round, waits until
every node of it is ready (``wait_ready``: a joiner's new workers start while ours train
on), writes each local rank's torchrun variables to the round file and waits until every
worker took them. The workers re-create their process group themselves
(``elastic.training.regroup``); the agent watches the same processes again and no restart
is spent. A worker that lost its group under it (a peer died mid-collective) marks itself
"broken" and the monitor re-forms the job for it.

Anything else takes the usual path: workers that did not say so (plain scripts), a
worker that died, or one that did not take the new round within ``BOUNDARY_WAIT`` plus
twice its longest step (stuck in a collective with a dead peer) are stopped and started
again in the new round; never one whose ranks agreed training is done, however long its
exit takes (``finished_untaken``). Never imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from elastic.core.agent.checkpoint_on_notice import Coordinator
from elastic.core.agent.outcome import Outcome
from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.job_keys import (
    FINISHED_KEY,
    LATE_ROUNDS_KEY,
    READY_KEY,
    REPLACED_KEY,
)
from elastic.core.interfaces.rendezvous import RendezvousHandler
from elastic.core.interfaces.spec import WorkerGroup
from elastic.core.interfaces.store import Store
from elastic.core.workers.control_file import ControlFile
from elastic.core.workers.env import worker_vars
from elastic.core.workers.process import WorkerProcess

# Outcomes that re-form the job without anything wrong on this node.
MEMBERSHIP_OUTCOMES = frozenset({Outcome.LOST_NODE, Outcome.MEMBERSHIP, Outcome.PEER_FAILED})
# s (plus twice the longest step) for the workers to reach a boundary and take the round
BOUNDARY_WAIT = 5.0
# s the kept workers train on while a joining node's new workers start (import torch,
# build the model): scripts that create their group with elastic.init_process_group say
# when they are about to join; others are waited for this long, then joined anyway.
READY_WAIT = 30.0
# s, the step between the moments nodes whose bounds ran out together give up (``patience``)
REPLACED_GRACE = 1.0
_POLL = 0.01


def can_regroup(outcome: Outcome, control: ControlFile, workers: Sequence[WorkerProcess]) -> bool:
    """Whether this attempt's end can be handled by regrouping the same workers."""
    return (
        outcome in MEMBERSHIP_OUTCOMES
        and bool(workers)
        and control.all_capable()
        and all(w.poll() is None for w in workers)
    )


def can_hand_to_starting(
    outcome: Outcome, control: ControlFile, workers: Sequence[WorkerProcess], store: Store
) -> bool:
    """Whether this attempt's end can be handled by handing the next round to workers
    that are still starting (none began connecting to its group, all alive), in a job whose
    workers take such a round (``LATE_ROUNDS_KEY``: they create their group with
    ``elastic.init_process_group``). Restarting them instead would throw their start-up
    away (import torch, building the model: seconds), again at every change.

    When it answers True, a regroup is requested in the control file first: a worker that
    begins its group from then on waits for the next round (``elastic.training.rounds``),
    and one that began before cannot have seen the request, so the answer is False."""
    if outcome not in MEMBERSHIP_OUTCOMES or not workers:
        return False
    if not control.none_connecting() or any(w.poll() is not None for w in workers):
        return False
    (late,) = store_call(store.multi_get, [LATE_ROUNDS_KEY])
    if not late:
        return False
    control.request_regroup(lost=outcome is not Outcome.MEMBERSHIP)
    return control.none_connecting()


class RoundWatch:
    """Called by the monitor every interval of a round: says whether the job must
    re-form now for workers that can regroup, and counts this node ready once.

    Re-form: a local worker's group broke (a peer died mid-collective), or every node of
    the round saved on a preemption notice: the noticed node leaves this moment, and our
    workers, stopped at that step, need not wait a heartbeat tick for its departure to be
    published (the round waits for it by itself). Ready: this node's new workers are about
    to join the round's group (``READY_KEY``); nodes that kept theirs wait for that."""

    def __init__(
        self,
        coordinator: Coordinator,
        world_size: int,
        *,
        counted: bool,
        calls: Callable[..., Any],
    ) -> None:
        self._coordinator = coordinator
        self._world_size = world_size
        self._counted = counted
        # The agent's bounded calls (``BoundedCalls``: ``store_call`` on a thread each)
        # for the store calls; most intervals make none (the control file is shared
        # memory).
        self._calls = calls

    def __call__(self) -> bool:
        coordinator = self._coordinator
        control = coordinator.control
        if not self._counted and control.all_ready():
            self._calls(_count_ready, coordinator)
            self._counted = True
        if control.broken():
            return True
        return (
            control.all_capable()
            and coordinator.counted  # no save counted here: no store call to make
            and self._calls(coordinator.complete, self._world_size)
        )


def _count_ready(coordinator: Coordinator) -> None:
    coordinator.store.add(READY_KEY.format(coordinator.round), 1)
    # Ready is said by elastic.init_process_group alone, which takes a round handed over
    # while the worker started: the job's workers can be handed one.
    coordinator.store.set(LATE_ROUNDS_KEY, "1")


def round_superseded(handler: RendezvousHandler, deferred: int = 0) -> bool:
    """Whether the round being readied will never form a group: it lost a member (a node
    died or left, a joiner whose new workers failed went away), or nodes wait for the next
    one, beyond the ``deferred`` ones the round left for it (``RendezvousInfo.deferred``:
    they join the round after this one, while its kept workers train). Either makes every
    member go on to that next round (a joiner's new workers cannot regroup yet and take
    the restart path; capable ones regroup again), so a node still waiting for this
    round's readiness would only miss it: the round forms without it after the last call.
    Both answers are the handler's cached ones, as the monitor's."""
    if store_call(handler.lost_nodes):
        return True
    return store_call(handler.num_nodes_waiting) > deferred


def lost_a_peer(handler: RendezvousHandler, peers: Collection[str] | None) -> bool:
    """Whether the round being readied, just superseded, lost a node that is a member of
    our workers' group (``peers``: its other members; None: not known). Their waits with
    it (a collective, a meeting) cannot end, so they are told to give them up at once; a
    lost joiner leaves their group whole, and they train on in it."""
    if not peers:
        return False
    return not set(store_call(handler.lost_nodes)).isdisjoint(peers)


def left_out_a_peer(
    handler: RendezvousHandler, deferred: int, peers: Collection[str] | None
) -> bool:
    """Whether the round just formed left for the next one (``deferred``) a member of our
    workers' group (``peers``): a node back with new workers, its old ones gone. The
    kept nodes train without it from this round on, and their group's waits with it (a
    collective with a peer whose cable was cut, whose connections never close) cannot
    end, so they are told to give them up at once, not after the sever bound."""
    if not deferred or not peers:
        return False
    members = store_call(handler.round_peers)
    return members is not None and not set(peers) <= set(members)


def wait_ready(
    store: Store,
    round_: int,
    world_size: int,
    workers: Sequence[WorkerProcess],
    sleep: Callable[[float], None],
    superseded: Callable[[], bool] = lambda: False,
) -> bool:
    """Count this node ready for round ``round_``, then wait (bounded by ``READY_WAIT``)
    until every node is: a joining node's workers import and set up while ours train on
    in the old group, so the pause is one step and a connect, not their start-up. Ends
    early when a local worker ended (the caller's next wait sees it).

    False when the round is superseded meanwhile (``round_superseded``): it will never
    form a group, so it is not handed to the workers (they would block joining it, past
    the agent's bound, and be restarted); the caller goes on to the next round, which the
    job is forming."""
    key = READY_KEY.format(round_)
    count = int(store_call(store.add, key, 1))
    deadline = time.monotonic() + READY_WAIT
    while count < world_size and time.monotonic() < deadline:
        if any(w.poll() is not None for w in workers):
            return True
        if superseded():
            return False
        sleep(_POLL)
        count = int(store_call(store.add, key, 0))
    return not superseded()


def finished(workers: Sequence[WorkerProcess], sleep: Callable[[float], None]) -> bool:
    """Whether the workers finished training (all exited 0) while the next round formed:
    the ranks agree on the last step, so once one is done the others follow at once."""
    if not any(w.poll() == 0 for w in workers):
        return False
    deadline = time.monotonic() + BOUNDARY_WAIT
    while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
        sleep(_POLL)
    return all(w.poll() == 0 for w in workers)


def finished_untaken(
    control: ControlFile,
    generation: int,
    workers: Sequence[WorkerProcess],
    sleep: Callable[[float], None],
) -> bool:
    """Whether the workers all finished training without taking round ``generation``: the
    step boundary meant to regroup them was their last (``elastic.train`` returns when the
    ranks agree they are done, before it regroups), so they finished in the old round.

    A worker finished once it exited 0, or once it marked itself done (its ranks agreed,
    ``DONE``) and is on its way out: the old group's last barrier and its teardown can
    outlast the bound for taking a round on a loaded machine, and restarting it then
    would start a fresh worker at step 0 that trains alone with the round's other new
    workers. Those are given ``BOUNDARY_WAIT`` to exit; the caller stops what is left. How
    a done worker exits does not matter: nothing runs again after done (as in the
    monitor's ``after_done``)."""
    taken = control.joined(generation)
    done = control.done()
    if not workers or any(w.local_rank in taken for w in workers):
        return False
    if not all(w.poll() == 0 or w.local_rank in done for w in workers):
        return False
    deadline = time.monotonic() + BOUNDARY_WAIT
    while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
        sleep(_POLL)
    return True


def announce_finished(store: Store, round_: int) -> None:
    """Our kept workers finished the job in the last round while ``round_`` formed: its
    new workers wait for a group that will not come. Their agents' job watch reads this
    and they meet ours at the round's exit barrier, so every node ends with success."""
    store_call(store.set, FINISHED_KEY.format(round_), "1")


def hand_over(
    control: ControlFile,
    group: WorkerGroup,
    workers: Sequence[WorkerProcess],
    *,
    run_id: str,
    use_agent_store: bool,
    error_files: Mapping[int, str],
) -> int:
    """Publish ``group``'s new round (placed by ``place_group``) to the running
    ``workers``, who keep their pids; returns the round's generation."""
    pids = {w.local_rank: w.pid for w in workers}
    envs = {}
    for worker in group.workers:
        worker.pid = pids.get(worker.local_rank)
        envs[worker.local_rank] = worker_vars(
            group,
            worker,
            run_id=run_id,
            use_agent_store=use_agent_store,
            error_file=error_files.get(worker.local_rank, ""),
        )
    control.request(0)  # a checkpoint request belonged to the round that is gone
    return control.hand_over(envs)


def wait_taken(
    control: ControlFile,
    generation: int,
    workers: Sequence[WorkerProcess],
    sleep: Callable[[float], None],
    replaced: Callable[[], bool] = lambda: False,
    patience: Callable[[], float] = lambda: 0.0,
) -> bool:
    """Until every worker took round ``generation``, ended or marked itself done (the
    caller and the monitor then judge how) (True), or the bound ran out (False).

    ``replaced()``: whether another node gave up on its workers in this round and is
    restarting them. Ours may be waiting only in a collective with one of those, which
    fails once it is stopped; then ours roll back and take the round. So when the bound
    runs out and another node replaced its workers, ours get ``BOUNDARY_WAIT`` more, once.
    The bounds of two such nodes run out together: ``patience()``, asked then (once), is
    how much longer this node looks for another's announcement before it gives up
    (``patience``)."""
    deadline = time.monotonic() + BOUNDARY_WAIT + 2 * control.longest_step()
    extended = False
    grace: float | None = None
    while True:
        taken = control.joined(generation) | control.done()  # done: they will not take it
        if all(w.local_rank in taken or w.poll() is not None for w in workers):
            return True
        now = time.monotonic()
        if now >= deadline:
            if extended:
                return False
            if replaced():
                extended, deadline = True, now + BOUNDARY_WAIT
                continue
            if grace is None:
                grace = patience()
            if now >= deadline + grace:
                return False
        sleep(_POLL)


class Untaken(NamedTuple):  # a named tuple: see AttemptEnd in core/agent/outcome.py
    """Where the workers that did not take a round are (``untaken``): ``waiting`` True
    when each waits in a collective, False when one does not (``stuck`` says where),
    None when the stacks cannot tell (a worker gave no dump)."""

    waiting: bool | None
    stuck: list[str]

    def explain(self) -> str:
        if self.stuck:
            return "; ".join(self.stuck)
        return "waiting in a collective" if self.waiting else "no stacks to tell where"


def untaken(control: ControlFile, generation: int, workers: Sequence[WorkerProcess]) -> Untaken:
    """Dump the stacks of the live workers that did not take round ``generation``
    (``core/watchdog/stacks.py``, no ptrace: each registered a dump file as it said it
    can regroup) and say whether each waits in a collective. Our own step agreement and
    state sync are collectives too: their innermost frames are ``torch.distributed``'s."""
    from elastic.core.watchdog.stacks import dump_stacks  # only when a bound runs out

    taken = control.joined(generation) | control.done()
    targets = {
        w.local_rank: (w.pid, control.stack_file(w.local_rank))
        for w in workers
        if w.local_rank not in taken and w.poll() is None
    }
    dumps = dump_stacks(targets)
    stuck = [
        f"local rank {rank} at {dump.where()}"
        for rank, dump in sorted(dumps.items())
        if dump.waiting_in() is None
    ]
    if stuck:
        return Untaken(False, stuck)
    return Untaken(True if dumps and len(dumps) == len(targets) else None, [])


def patience(waiting: bool | None, first: bool) -> float:
    """Seconds a node whose bound for taking a round ran out, and no other node announced
    it replaced its workers, still looks for that announcement (``wait_taken``). The
    bounds of the nodes run out about together when one node's worker is stuck in a long
    step and the others wait for it in a collective, so the order they give up in decides
    which workers are kept:

    - a worker of ours not in a collective (``waiting`` False): at once, it is stuck here;
    - the stacks cannot tell (``waiting`` None: a worker gave no dump, not Python): at
      once, but the round's rank 0 (``first``) for ``REPLACED_GRACE``, the tie-break;
    - every worker of ours waits in a collective: ``BOUNDARY_WAIT`` (the round's rank 0
      ``REPLACED_GRACE`` more, so when every node's workers wait in collectives one node
      gives up and rank 0 keeps its workers). That long because each node's bound starts
      when it hands the round over and counts its own workers' last step: on a loaded
      machine the stuck node's runs out seconds after ours, and a node whose workers are
      only waiting loses little by waiting, where giving up first restarts them too."""
    if waiting is None:
        return REPLACED_GRACE * first
    return BOUNDARY_WAIT + REPLACED_GRACE * first if waiting else 0.0


def announce_replaced(store: Store, round_: int) -> None:
    """This node gave up waiting for its workers to take ``round_`` and restarts them: the
    others' workers, waiting for ours in a collective, are about to be freed."""
    store_call(store.add, REPLACED_KEY.format(round_), 1)


def replaced_in(store: Store, round_: int) -> bool:
    """Whether a node announced ``announce_replaced`` for ``round_``."""
    return int(store_call(store.add, REPLACED_KEY.format(round_), 0)) > 0
