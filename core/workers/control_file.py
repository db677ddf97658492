"""The control file: how an agent asks its workers to checkpoint, and learns they did.

One file per node and attempt, mapped shared by the agent and its workers: an 8-byte
request number, then one slot per local rank with (listening, saved) request numbers.
"Listening" says the script uses the API at all (``elastic.checkpoint_requested()``): an
agent whose workers never asked does not wait for a save that will not come. The agent's
end is ``ControlFile``; the workers' end is ``elastic.training.preemption``; the layout
constants below are the one definition both read.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile

ENV_CONTROL = "ELASTIC_CONTROL_FILE"
HEADER = struct.Struct("<Q")  # the request number; 0: none
SLOT = struct.Struct("<QQ")  # per local rank: (listening, saved request number)
# A worker may learn of a request from its peers (the all_reduce of the flag) before its
# own agent has raised it locally: it then saves "for whatever request is pending".
SAVED_PENDING = 2**64 - 1


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
