"""The sync after a start or a regroup: one rank's step and state for every rank.

``elastic.train`` gathers every rank's step number, names the most tenured rank (the
highest step; the lowest rank on ties) and calls ``state.sync`` with that rank known
(``tenured_rank()``). The step number is that rank's, and one small all_gather then
proves the state is too: every rank's ``State.sync_digest()`` after the sync must equal
the tenured rank's before it. A mismatch is one error, the same on every rank, naming
the ranks that differ: the job stops instead of training on diverged replicas.

The digest (``snapshot_digest``) is a BLAKE2b hash of the snapshot's content, stable
across processes: numbers, strings, bytes and containers by value (mappings and sets in
an order of their own, not their insertion order), tensors and numpy arrays by dtype,
shape and raw bytes, anything else by its pickle. It costs one read of the state, so it
runs at those syncs only, never per step.
"""

from __future__ import annotations

import ctypes
import hashlib
import pickle
import struct
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

DIGEST_SIZE = 16  # bytes: two int64 in the all_gather
_WORDS = DIGEST_SIZE // 8
# The rank ``state.sync`` must hand out; set only while elastic.train runs a sync.
_source: list[int] = []


def tenured_rank() -> int:
    """The rank whose state every rank takes in the ``State.sync`` that ``elastic.train``
    is running: the one with the highest step (the lowest rank on ties), whose step
    number the job goes on from. Valid only inside that sync."""
    if not _source:
        raise RuntimeError(
            "elastic.tenured_rank() is known only inside a State.sync that elastic.train calls"
        )
    return _source[0]


@contextmanager
def syncing_from(source: int) -> Iterator[None]:
    """``tenured_rank()`` is ``source`` for the duration."""
    _source[:] = [source]
    try:
        yield
    finally:
        _source.clear()


def most_tenured(steps: list[int]) -> int:
    """The rank with the highest step; the lowest such rank on ties."""
    return max(range(len(steps)), key=lambda r: (steps[r], -r))


def snapshot_digest(snapshot: Any) -> bytes:
    """A digest of ``snapshot``'s content, equal on every process that holds equal content.

    Raises TypeError for a part that neither has a rule here nor pickles."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    _feed(h, snapshot)
    return h.digest()


def _feed(h: Any, obj: Any) -> None:
    if obj is None or isinstance(obj, bool):
        h.update(b"N" if obj is None else b"B1" if obj else b"B0")
    elif isinstance(obj, int):
        h.update(b"I%d;" % obj)
    elif isinstance(obj, float):
        h.update(b"F" + struct.pack("<d", obj))
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        h.update(b"S%d;" % len(data) + data)
    elif isinstance(obj, (bytes, bytearray)):
        h.update(b"Y%d;" % len(obj) + bytes(obj))
    elif isinstance(obj, (list, tuple)):
        h.update(b"%s%d;" % (b"L" if isinstance(obj, list) else b"T", len(obj)))
        for item in obj:
            _feed(h, item)
    elif isinstance(obj, Mapping):  # a state_dict's key order is not part of its content
        pairs = sorted(snapshot_digest(k) + snapshot_digest(v) for k, v in obj.items())
        h.update(b"D%d;" % len(pairs) + b"".join(pairs))
    elif isinstance(obj, (set, frozenset)):
        h.update(b"E%d;" % len(obj) + b"".join(sorted(snapshot_digest(i) for i in obj)))
    elif not _feed_array(h, obj):
        try:
            data = pickle.dumps(obj, protocol=5)
        except Exception as exc:
            raise TypeError(f"cannot digest a {type(obj).__qualname__}: {exc}") from None
        h.update(b"P%d;" % len(data) + data)


def _feed_array(h: Any, obj: Any) -> bool:
    """A torch tensor or numpy array by dtype, shape and bytes; False for anything else."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
        flat = obj.detach().cpu().contiguous().reshape(-1)
        h.update(b"X%s%s;" % (str(obj.dtype).encode(), str(tuple(obj.shape)).encode()))
        if flat.numel():  # its bytes in place: no copy of a large parameter
            h.update(
                (ctypes.c_ubyte * (flat.numel() * flat.element_size())).from_address(
                    flat.data_ptr()
                )
            )
        return True
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray) and obj.dtype != object:
        h.update(b"A%s%s;" % (obj.dtype.str.encode(), str(obj.shape).encode()))
        h.update(numpy.ascontiguousarray(obj).reshape(-1).view(numpy.uint8))
        return True
    return False


def digest_words(digest: bytes | None) -> list[int]:
    """``digest`` as [present, int64...] for an int64 collective."""
    if digest is None:
        return [0] * (1 + _WORDS)
    words = [
        int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, DIGEST_SIZE, 8)
    ]
    return [1, *words]


def mismatched_ranks(rows: list[list[int]], source: int) -> list[int] | None:
    """The ranks whose state after the sync differs from ``source``'s before it, from every
    rank's ``digest_words(before) + digest_words(after)``; None when there is nothing to
    compare (the source's ``sync_digest`` gave None). A rank that gave None is not judged."""
    width = 1 + _WORDS
    expected = rows[source][:width]
    if not expected[0]:
        return None
    return [r for r, row in enumerate(rows) if row[width] and row[width:] != expected]
