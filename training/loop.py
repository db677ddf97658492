"""``elastic.train``: run train steps with rollback on failure and periodic checkpoints.

The contract: ``train_step(state)`` does one unit of work (typically one mini-batch) and
returns True when training is done, anything falsy to go on.

A process start loads the newest checkpoint, if any, and calls ``state.sync`` so workers
that have no checkpoint get the most tenured worker's state (``elastic.tenured_rank()``:
the highest step, the lowest rank on ties); the step number is that worker's too, and a
check that every rank then holds its state ends the job with one error when one does
not (``elastic.training.tenure``). A step that raises is rolled
back: the snapshot captured before it is applied, ``sync`` is called and the step is
tried again, up to ``max_step_retries`` times in a row; after that, or when the state
returns no snapshot (rollback not supported), the exception propagates and the agent
restarts the workers.

When ``torch.distributed`` is initialized, ranks agree after every step (one small
all_reduce) on whether any of them failed, is done, saw a preemption notice or was asked
to regroup, so they roll back and stop together. A step that raises must therefore not
leave a collective half-issued: raise before or after the step's collectives, or let the
process die and be restarted.

Under ``elastic run`` the workers regroup in place (``elastic.training.regroup``): on a
membership change (a node preempted, gone or joining) every rank stops at the same step
boundary, re-creates the process group in the agent's new round, calls
``state.sync(world_size, rank)`` (the new ranks get the most tenured worker's state) and
goes on: no process restart, nothing loaded from disk. When the agreement itself fails
(a peer died mid-collective), the step is rolled back to its snapshot and the worker
waits for the new round the same way; without a snapshot it cannot, and raises. A sync
that breaks the same way (a peer died while the state was handed out) is undone too:
every rank puts back the state it held before it (a receiver may hold half of the
source's), and the sync runs again in the next round (``_sync_through_breaks``).

Every step (and every checkpoint save) calls ``elastic.heartbeat()``: under
``elastic run --stall-timeout`` the worker is judged by those heartbeats.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from elastic.core import checkpoint as ckpt
from elastic.core.metrics import put_metric, timed
from elastic.core.workers.control_file import DONE
from elastic.training import control, regroup, tenure
from elastic.training.bounded import wait_work
from elastic.training.heartbeat import heartbeat
from elastic.training.preemption import checkpoint_requested, checkpoint_saved, mark_saved
from elastic.training.state import State

GROUP = "elastic.train"


def _dist() -> Any:
    """``torch.distributed`` if it is initialized; never imports torch itself."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def _all_reduce_max(values: list[int]) -> list[int]:
    """Element-wise max over all ranks (identity without a process group)."""
    dist = _dist()
    if dist is None:
        return values
    import torch

    tensor = torch.tensor(values, dtype=torch.int64, device=_device(dist))
    wait_work(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True), "the step agreement")
    return [int(v) for v in tensor.tolist()]


def _all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (as many on each), in rank order; needs a process group."""
    dist = _dist()
    import torch

    mine = torch.tensor(values, dtype=torch.int64, device=_device(dist))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    wait_work(dist.all_gather(every, mine, async_op=True), "the state sync's all_gather")
    return [[int(v) for v in t.tolist()] for t in every]


def _device(dist: Any) -> str:
    import torch

    if dist.get_backend() == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _resolve_checkpointer(
    checkpointer: ckpt.Checkpointer | str | None,
) -> ckpt.Checkpointer | None:
    if checkpointer is None:
        return ckpt.checkpointer_from_env()
    if isinstance(checkpointer, str):
        return ckpt.load_checkpointer(checkpointer) if checkpointer else None
    return checkpointer


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def train(
    train_step: Callable[[Any], Any],
    state: State,
    *,
    checkpointer: ckpt.Checkpointer | str | None = None,
    checkpoint_every: int = 100,
    max_step_retries: int = 3,
    world_size: int | None = None,
    rank: int | None = None,
    regroup_in_place: bool = True,
) -> int:
    """Run ``train_step(state)`` until it returns True; return the number of the last
    completed step (steps restored from a checkpoint count).

    ``checkpointer``: a Checkpointer, a spec such as ``"fs:/ckpt"``, or None to use
    ``ELASTIC_CHECKPOINT`` when it is set (no checkpoints otherwise; pass ``""`` to
    ignore the variable). A checkpoint is saved every ``checkpoint_every`` steps and
    once more when training is done. ``world_size`` and ``rank`` default to the
    launcher's ``WORLD_SIZE`` and ``RANK``. ``regroup_in_place=False`` keeps the workers
    out of in-place regrouping: a membership change then restarts them (and a preemption
    notice stops them after the save), as under torchrun.
    """
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    rank = _env_int("RANK", 0) if rank is None else rank
    saver = _resolve_checkpointer(checkpointer)

    # under elastic run: keep running through membership changes
    in_place = regroup_in_place and regroup.opt_in()
    step = 0
    if saver is not None:
        with timed("checkpoint.load", GROUP):
            loaded = saver.load_latest(state.load)
        step = loaded or 0
    step, world_size, rank = _sync_through_breaks(state, step, world_size, rank, in_place)
    saved_at = step

    retries = 0
    while True:
        snapshot = state.capture_snapshot()
        error: BaseException | None = None
        done = False
        try:
            done = bool(train_step(state))
        except Exception as exc:
            error = exc
        heartbeat()  # a step ran: progress for the agent's --stall-timeout
        try:
            # One all_reduce: did any rank fail, finish, see a preemption notice, or is
            # the job re-forming?
            changing = in_place and regroup.membership_changed()
            any_failed, any_done, preempted, changed = _all_reduce_max(
                [error is not None, done, checkpoint_requested(), changing]
            )
        except Exception as broke:  # the group broke under us: a peer died mid-step
            if not in_place or snapshot is None:
                raise  # as before: the worker fails and the agent restarts it
            # every survivor redoes this step
            what = f"train step {step + 1} broke ({broke!r}); rolled back"
            world_size, rank = _undo_and_regroup(state, snapshot, what)
            step, world_size, rank = _sync_through_breaks(state, step, world_size, rank, in_place)
            continue
        if any_failed:
            retries += 1
            if snapshot is None or retries > max_step_retries:
                if error is not None:
                    raise error
                raise RuntimeError(
                    f"a peer rank's train step {step + 1} failed and cannot be rolled back"
                )
            put_metric("rollback", 1, GROUP)
            print(
                f"elastic: train step {step + 1} failed on rank "
                f"{rank if error else 'of a peer'} ({error!r}); rolled back, retry {retries}"
                f"/{max_step_retries}",
                file=sys.stderr,
            )
            state.apply_snapshot(snapshot)
            with tenure.syncing_from(0):  # every rank is at this same step
                state.sync(world_size, rank)
            continue
        retries = 0
        step += 1
        if saver is not None and (step % checkpoint_every == 0 or any_done) and step != saved_at:
            with timed("checkpoint.save", GROUP):
                saver.save(step, state.save)
            saved_at = step
            heartbeat()  # a long save is progress too
        if any_done:
            # Every rank agreed: a crash from here on (the script's own exit, a group
            # torn down) must not run the job again from its start (the agent reads it).
            control.set_mine(DONE, 1)
            return step
        if preempted:  # every rank is at this same step: save it, then re-form
            if saver is not None and step != saved_at:
                with timed("checkpoint.save", GROUP):
                    saver.save(step, state.save)
                saved_at = step
            if not in_place:
                checkpoint_saved()  # waits to be stopped: the job restarts from the save
            mark_saved()
        if in_place and (preempted or changed):
            world_size, rank = regroup.regroup()
            step, world_size, rank = _sync_through_breaks(state, step, world_size, rank, in_place)


class SyncMismatchError(RuntimeError):
    """After a sync the ranks do not all hold the most tenured rank's state: the same
    error on every rank (a wrong ``State.sync``), never retried."""


MAX_SYNC_BREAKS = 3  # syncs broken in a row (a peer died in each) before the worker gives up


def _sync_through_breaks(
    state: State, step: int, world_size: int, rank: int, in_place: bool
) -> tuple[int, int, int]:
    """``_sync``; when it breaks under a regrouping worker (a peer died while the state
    was handed out), every rank puts back the state it held before it, the job re-forms
    and the sync runs again in the new round. Returns (step, world_size, rank)."""
    breaks = 0
    while True:
        snapshot = state.capture_snapshot() if in_place else None
        try:
            return _sync(state, step, world_size, rank), world_size, rank
        except SyncMismatchError:
            raise
        except Exception as broke:
            breaks += 1
            if snapshot is None or breaks > MAX_SYNC_BREAKS:
                raise
            # a receiver may hold half of the source's state
            what = f"the state sync broke ({broke!r}); put back"
            world_size, rank = _undo_and_regroup(state, snapshot, what)


def _undo_and_regroup(state: State, snapshot: Any, what: str) -> tuple[int, int]:
    """A collective broke under this rank (a peer died): put ``snapshot`` back, say
    ``what`` happened, and wait for the job to re-form with this rank's slot marked
    broken. Returns (world_size, rank) in the new round."""
    state.apply_snapshot(snapshot)
    put_metric("rollback", 1, GROUP)
    print(f"elastic: {what}, waiting for the job to re-form", file=sys.stderr)
    return regroup.regroup(broken=True)


def _sync(state: State, step: int, world_size: int, rank: int) -> int:
    """``state.sync`` from the most tenured rank; returns that rank's step number.

    Ranks that started without the checkpoint, joined, or rolled back a step a peer's
    death cut short have a lower step than the tenured rank and take its state: the step
    comes from the same rank. Afterwards every rank's ``sync_digest`` must equal the
    tenured rank's from before the sync (``elastic.training.tenure``)."""
    dist = _dist()
    if dist is None:
        with tenure.syncing_from(rank):
            state.sync(world_size, rank)
        return step
    steps = [row[0] for row in _all_gather_ints([step])]
    source = tenure.most_tenured(steps)
    digest = getattr(state, "sync_digest", None)
    before = digest() if digest is not None and rank == source else None
    with tenure.syncing_from(source):
        state.sync(world_size, rank)
    after = digest() if digest is not None else None
    rows = _all_gather_ints(tenure.digest_words(before) + tenure.digest_words(after))
    differ = tenure.mismatched_ranks(rows, source)
    if differ:
        raise SyncMismatchError(
            f"elastic.train: after State.sync, rank(s) {', '.join(map(str, differ))} of "
            f"{len(rows)} do not hold the state of rank {source}, the most tenured (step "
            f"{steps[source]}): sync must hand out the state of elastic.tenured_rank() (or "
            "State.sync_digest must leave out what differs by rank)"
        )
    return steps[source]
