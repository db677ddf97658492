"""Regrouping in place: the worker's side of a membership change without a restart.

Under ``elastic run`` a worker that says it can (``opt_in``; ``elastic.train`` does, and so
does the first call of ``membership_changed``) keeps running when a node leaves or joins.
Its agent raises a regroup request in the node's control file; the worker sees it at a
step boundary (``membership_changed``: one read of shared memory), and ``regroup`` then
leaves the process group, waits for the agent's next round, takes its variables
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` ... all of torchrun's) into
``os.environ`` and creates the default group again with the same backend. The ranks must
agree on the step to stop at, so a script checks the flag through one all_reduce::

    flag = torch.tensor([int(elastic.membership_changed())])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        world_size, rank = elastic.regroup()
        ddp = DDP(model)  # DDP is bound to its group: build it again on the new one
        # ... and give the new ranks the state (broadcast from the most tenured rank)

A worker whose group broke under it (a peer died mid-collective) calls
``regroup(broken=True)``: the agent, told through the control file, re-forms the job.
The agent bounds everything: a worker that does not reach a boundary in time is stopped
and the node restarts as before, so no wait here is unbounded either.
"""

from __future__ import annotations

import os
import sys
import time

from elastic.core.interfaces.failures import names_peer_loss
from elastic.core.workers.boot.sitecustomize import install
from elastic.core.workers.control_file import (
    BROKEN,
    CAPABLE,
    ENV_CONTROL,
    JOINED,
    REGROUP_FIELD,
    SAVED,
    STEP_US,
    stack_path,
)
from elastic.training import control, rounds, sever
from elastic.training.bounded import RoundMoved
from elastic.training.dist import leave_group, rejoin_group

# Joins in a row whose connect failed under a lost peer before the worker gives up (and
# its agent restarts it): each is a round that lost a member while its ranks connected.
MAX_FAILED_JOINS = 3
# When this worker last passed a step boundary (``membership_changed``); empty before the
# first. A regroup's wait for the round is not a step: it starts the count again.
_last_boundary: list[float] = []


def opt_in() -> bool:
    """Tell the agent this worker can regroup in place; False outside ``elastic run``."""
    if not control.available():
        return False
    if not control.mine(CAPABLE):
        # The agent, its bound for taking a round run out, asks where this worker is:
        # waiting in a collective (a peer is stuck) or stuck itself (core/agent/regroup.py).
        install(stack_path(os.environ[ENV_CONTROL], control.slot_index()))
        # The script's own collectives wait in C++: freed by cutting the group's sockets.
        sever.start()
        control.set_mine(CAPABLE, 1)
    return True


def membership_changed() -> bool:
    """True when the job asks its workers to regroup at this step boundary (a node left
    or joins). Cheap: one read of shared memory; False outside ``elastic run``.

    It is called once per step boundary, so the time since the last call is a step's
    length, agreement and checkpoints included: the agent waits that long (twice, and
    more) for the workers to reach a boundary, for ``elastic.train`` and for scripts that
    call this themselves alike."""
    if not opt_in():
        return False
    now = time.monotonic()
    if _last_boundary:
        control.set_mine(STEP_US, int((now - _last_boundary[0]) * 1e6))
    _last_boundary[:] = [now]
    return control.header(REGROUP_FIELD) > control.mine(JOINED)


def regroup(*, broken: bool = False) -> tuple[int, int]:
    """Leave the default process group, wait for the agent's next round, take its
    variables into ``os.environ`` and create the default group again with the same
    backend. Returns ``(world_size, rank)`` in the new round. ``broken``: the group
    failed under this worker (a peer died), which asks the agent to re-form the job."""
    if not opt_in():
        raise RuntimeError("elastic.regroup() needs a worker started by `elastic run`")
    joined = control.mine(JOINED)
    if broken:
        control.set_mine(BROKEN, joined + 1)
    leave_group()
    failed_joins = 0
    while True:
        generation, env = rounds.wait_for_round(joined)
        os.environ.update(env)
        control.set_mine(JOINED, generation)  # the agent's acknowledgement: we are joining
        control.set_mine(BROKEN, 0)
        control.set_mine(SAVED, 0)  # a save on notice belonged to the round that is gone
        try:
            rejoin_group()
            break
        except RoundMoved:  # a rank of this round is gone: on to the newer one
            joined = generation
        except RuntimeError as exc:
            # gloo's connect failed: a rank of this round died while the ranks connected
            # (after they met). Like a group that broke under a step: the job re-forms,
            # and this worker, its state kept, joins the next round.
            failed_joins += 1
            said = f"{type(exc).__name__}: {exc}"  # torch's DistNetworkError says little else
            if failed_joins > MAX_FAILED_JOINS or not names_peer_loss(said):
                raise
            print(
                f"elastic: joining round {generation} failed ({exc!r}); waiting for the job "
                "to re-form",
                file=sys.stderr,
                flush=True,
            )
            leave_group()
            control.set_mine(BROKEN, generation + 1)
            joined = generation
    _last_boundary.clear()
    return int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
