"""The worker's end of a file its agent shares with it (the control file, the progress
file): named in an environment variable, mapped read-write once."""

from __future__ import annotations

import mmap
import os


def map_from_env(variable: str, size: int | None = None) -> mmap.mmap:
    """The file named by ``variable``, mapped: its first ``size`` bytes, or all of it.
    OSError when the variable is unset (not under ``elastic run``) or the file cannot be
    mapped, ValueError when it is shorter than ``size``: the caller then does without."""
    path = os.environ.get(variable)
    if not path:
        raise OSError(f"{variable} is not set: not under elastic run")
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size if size is None else size)
    finally:
        os.close(fd)
