"""``elastic.train``: run train steps with rollback on failure and periodic checkpoints.

The contract: ``train_step(state)`` does one unit of work (typically one mini-batch) and
returns True when training is done, anything falsy to go on.

Every process start (the first, and every restart after a failure or membership
change, since the agent restarts all workers) loads the newest checkpoint, if any, and
calls ``state.sync`` so workers that have no checkpoint get the most tenured worker's
state. A step that raises is rolled back: the snapshot captured before it is applied,
``sync`` is called and the step is tried again, up to ``max_step_retries`` times in a
row; after that, or when the state returns no snapshot (rollback not supported), the
exception propagates and the agent restarts the workers.

When ``torch.distributed`` is initialized, ranks agree after every step (one small
all_reduce) on whether any of them failed or is done, so they roll back and stop
together. A step that raises must therefore not leave a collective half-issued: raise
before or after the step's collectives, or let the process die and be restarted.

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
from elastic.training.heartbeat import heartbeat
from elastic.training.preemption import checkpoint_requested, checkpoint_saved
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

    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


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
) -> int:
    """Run ``train_step(state)`` until it returns True; return the number of the last
    completed step (steps restored from a checkpoint count).

    ``checkpointer``: a Checkpointer, a spec such as ``"fs:/ckpt"``, or None to use
    ``ELASTIC_CHECKPOINT`` when it is set (no checkpoints otherwise; pass ``""`` to
    ignore the variable). A checkpoint is saved every ``checkpoint_every`` steps and
    once more when training is done. ``world_size`` and ``rank`` default to the
    launcher's ``WORLD_SIZE`` and ``RANK``.
    """
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    rank = _env_int("RANK", 0) if rank is None else rank
    saver = _resolve_checkpointer(checkpointer)

    step = 0
    if saver is not None:
        with timed("checkpoint.load", GROUP):
            loaded = saver.load_latest(state.load)
        step = loaded or 0
    state.sync(world_size, rank)
    # Ranks without the checkpoint (a node's local disk) got the state from sync; they
    # take the step number from the most tenured rank too.
    step = _all_reduce_max([step])[0]
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
        # One all_reduce: did any rank fail, finish, or see a preemption notice?
        any_failed, any_done, preempted = _all_reduce_max(
            [error is not None, done, checkpoint_requested()]
        )
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
            return step
        if preempted:  # every rank is at this same step: save it, then wait to re-form
            if saver is not None and step != saved_at:
                with timed("checkpoint.save", GROUP):
                    saver.save(step, state.save)
                saved_at = step
            checkpoint_saved()
