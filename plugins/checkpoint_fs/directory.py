"""The ``fs`` checkpointer: numbered checkpoint files in one directory.

``--checkpoint fs:DIR`` (workers see ``ELASTIC_CHECKPOINT=fs:DIR``). Only rank 0 writes;
every rank can load (a shared directory, or each node's own copy). The last
``ELASTIC_CHECKPOINT_KEEP`` (default 3) checkpoints are kept.

Why a partial file is never loaded:

1. the checkpoint is written to a hidden temp name in the same directory, fsynced, then
   renamed over its final name (rename is atomic on POSIX), and the directory is fsynced;
2. each file starts with a header (magic, payload size, SHA-256 of the payload) that is
   checked before the payload is handed to the reader. A file that fails the check (torn
   by a crash of the storage, truncated by a copy) is skipped for the next older one.
   The payload is read into memory and verified before the reader sees any of it.

File layout: ``ckpt-<step, 12 digits>.elastic`` =
``b"ELCKPT1\\n"`` + size (8 bytes, little endian) + sha256 (32 bytes) + payload.

``FsCheckpointer``, entry point ``fs`` in ``elastic.checkpoint``: loaded by the workers
that use it, never by an agent.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import struct
from pathlib import Path
from typing import IO

from elastic.core.checkpoint import Reader, Writer
from elastic.core.log import say

MAGIC = b"ELCKPT1\n"
HEADER = struct.Struct("<8sQ32s")
ENV_KEEP = "ELASTIC_CHECKPOINT_KEEP"
_FINAL = re.compile(r"^ckpt-(\d{12})\.elastic$")
_TEMP = re.compile(r"^\.ckpt-\d+\.(\d+)\.tmp$")


class _HashingWriter(io.RawIOBase):
    """Passes bytes to the file while hashing and counting them (write-only stream)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self._f.write(view)
        self.sha.update(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the rename itself durable
    finally:
        os.close(fd)


class FsCheckpointer:
    """Atomic, checksummed checkpoint files in ``directory``; see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3, rank: int | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory).expanduser().absolute()
        self.keep = keep
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:012d}.elastic"

    def steps(self) -> list[int]:
        """Steps of the complete-looking checkpoints, newest first (no content check)."""
        if not self.directory.is_dir():
            return []
        found = (_FINAL.match(p.name) for p in self.directory.iterdir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def save(self, step: int, write: Writer) -> None:
        if self.rank != 0:  # one writer per job; the others get the state via sync
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".ckpt-{step}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, 0, b"\0" * 32))  # filled in once the size is known
                stream = _HashingWriter(f)
                write(stream)  # type: ignore[arg-type]
                f.seek(0)
                f.write(HEADER.pack(MAGIC, stream.size, stream.sha.digest()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path_for(step))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        self._prune()

    def _prune(self) -> None:
        for step in self.steps()[self.keep :]:
            self.path_for(step).unlink(missing_ok=True)
        # Temp files of writers that died mid-save (SIGKILL leaves them behind).
        for p in self.directory.iterdir():
            m = _TEMP.match(p.name)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                p.unlink(missing_ok=True)

    def read_payload(self, step: int) -> bytes | None:
        """The payload of ``step``'s checkpoint, or None if it is missing or corrupt."""
        try:
            with open(self.path_for(step), "rb") as f:
                header = f.read(HEADER.size)
                payload = f.read()
        except FileNotFoundError:  # pruned by rank 0 while we were listing
            return None
        if len(header) != HEADER.size:
            return None
        magic, size, digest = HEADER.unpack(header)
        if magic != MAGIC or size != len(payload) or hashlib.sha256(payload).digest() != digest:
            return None
        return payload

    def load_latest(self, read: Reader) -> int | None:
        for step in self.steps():
            payload = self.read_payload(step)
            if payload is None:
                say(
                    f"elastic: checkpoint {self.path_for(step)} is incomplete or corrupt; "
                    "trying an older one",
                    logging.WARNING,
                )
                continue
            read(io.BytesIO(payload))
            return step
        return None


def create_checkpointer(arg: str | None) -> FsCheckpointer:
    """Entry point ``fs``: ``fs:DIR``."""
    if not arg:
        raise ValueError("the fs checkpointer needs a directory: --checkpoint fs:DIR")
    return FsCheckpointer(arg, keep=int(os.environ.get(ENV_KEEP, "3")))
