"""``elastic.State``: what a training job must be able to sync, snapshot and persist.

All workers create their state with the same constructor arguments (the bootstrap state
S_0, which any worker can build alone). Subclasses override what they need:

- ``sync(world_size, rank)``: give every worker a consistent view: broadcast the state
  of ``elastic.tenured_rank()`` (the most tenured worker: the highest step, the lowest
  rank on ties; the job goes on from its step number) and rebuild data loaders. Called
  at start, after a checkpoint is loaded, after every regroup and after every rollback.
  Not for per-step collectives (those belong in the train step).
- ``sync_digest()``: what proves, after a start or regroup sync, that every rank holds
  the tenured rank's state. The default digests ``capture_snapshot()`` (see
  ``elastic.training.tenure``); override it to digest only what the ranks share (a
  snapshot with rank-local parts), or return None to skip the check.
- ``capture_snapshot()`` / ``apply_snapshot(snapshot)``: rollback of a failed train
  step. The default snapshot is None, which means "rollback not supported".
  ``apply_snapshot`` should act like a setter: applying a snapshot to *any* state and
  then calling ``sync`` must restore the state at capture time.
- ``save(stream)`` / ``load(stream)``: checkpoints. The defaults write the snapshot with
  ``torch.save`` and read it back with ``torch.load(weights_only=True)`` (tensors,
  numbers, strings and containers of them; no arbitrary unpickling of files on disk).
  Override both if your snapshot holds other objects.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from elastic.training.tenure import snapshot_digest

_warned: list[bool] = []


class State:
    """Base class for a job's training state; every method has a safe default."""

    def sync(self, world_size: int, rank: int) -> None:
        """Make every worker's state consistent; the default does nothing."""

    def sync_digest(self) -> bytes | None:
        """A digest of the state every rank must share after ``sync`` (None: not checked).

        The default digests ``capture_snapshot()``: None when that is None, and None with
        a warning when a part of it cannot be digested."""
        snapshot = self.capture_snapshot()
        if snapshot is None:
            return None
        try:
            return snapshot_digest(snapshot)
        except TypeError as exc:
            if not _warned:
                _warned.append(True)
                print(
                    f"elastic: {exc}; ranks are not checked to hold the same state after "
                    "sync (override State.sync_digest)",
                    file=sys.stderr,
                )
            return None

    def capture_snapshot(self) -> Any:
        """Return what ``apply_snapshot`` needs to restore this state (None: no rollback)."""
        return None

    def apply_snapshot(self, snapshot: Any) -> None:
        """Restore the state a snapshot was captured from; the default does nothing."""

    def save(self, stream: IO[bytes]) -> None:
        """Write a checkpoint of this state to a binary stream."""
        import torch  # lazily: the launcher imports elastic without torch

        torch.save(self.capture_snapshot(), stream)

    def load(self, stream: IO[bytes]) -> None:
        """Restore this state from what ``save`` wrote."""
        import torch

        self.apply_snapshot(torch.load(stream, weights_only=True))
