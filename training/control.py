"""The worker's end of its node's control file (``elastic.core.workers.control_file``):
mapped on first use, read and written one 8-byte field at a time. Outside ``elastic run``
(no ``ELASTIC_CONTROL_FILE``) there is none, and every reader answers "nothing asked"."""

from __future__ import annotations

import mmap
import os
import struct

from elastic.core.workers.control_file import (
    ENV_CONTROL,
    ENV_CONTROL_SLOT,
    SLOT,
    field_offset,
    slot_offset,
)
from elastic.training.agent_file import map_from_env

_WORD = struct.Struct("<Q")

_map: mmap.mmap | None = None
_slot = 0
_off = False


def _open() -> bool:
    global _map, _slot, _off
    try:
        _map = map_from_env(ENV_CONTROL)
        local_rank = slot_index()
        _slot = slot_offset(local_rank)
        if local_rank < 0 or _slot + SLOT.size > len(_map):
            raise ValueError(f"LOCAL_RANK {local_rank} has no slot in the control file")
    except (OSError, ValueError):
        if _map is not None:  # mapped, but no slot of ours: none of it is read
            _map.close()
            _map = None
        _off = True
        return False
    return True


def slot_index() -> int:
    """This worker's slot: its local rank as the agent numbered it."""
    return int(os.environ.get(ENV_CONTROL_SLOT) or os.environ.get("LOCAL_RANK", "0"))


def available() -> bool:
    """Whether this worker has a control file (it runs under ``elastic run``)."""
    return _map is not None or (not _off and _open())


def header(field: int) -> int:
    if not available():
        return 0
    assert _map is not None
    return int(_WORD.unpack_from(_map, field_offset(field))[0])


def mine(field: int) -> int:
    if not available():
        return 0
    assert _map is not None
    return int(_WORD.unpack_from(_map, _slot + field_offset(field))[0])


def set_mine(field: int, value: int) -> None:
    if available():
        assert _map is not None
        _WORD.pack_into(_map, _slot + field_offset(field), value)


def path() -> str:
    return os.environ.get(ENV_CONTROL, "")


def reset_for_tests() -> None:
    global _map, _off
    if _map is not None:
        _map.close()
    _map, _off = None, False
