"""``elastic.record``: decorate a worker's entry function so an uncaught exception is
written, with its traceback, to the file the agent named in ``TORCHELASTIC_ERROR_FILE``.

A drop-in for torch's ``torch.distributed.elastic.multiprocessing.errors.record``: same
file format (torch's agent reads our files and ours reads torch's), same handling of
``SystemExit``. It runs in every worker, so importing it must stay cheap: it never
imports torch, and the error-file writer is only imported when something failed.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import TypeVar

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

log = logging.getLogger("elastic.record")

_R = TypeVar("_R")


def _enable_faulthandler() -> None:
    """Dump every thread's Python stack to stderr on SIGSEGV/SIGBUS/SIGABRT, as torch's
    ``ErrorHandler.initialize`` does: a crash writes no error file, so stderr (whose last
    lines the agent shows) is the only place its stack can go."""
    try:
        if not faulthandler.is_enabled():
            faulthandler.enable(file=sys.stderr, all_threads=True)
    except Exception:  # e.g. stderr closed or not a real file: nothing to dump into
        pass


def record_exception(exc: BaseException, skip_frames: int = 0) -> None:
    """Write ``exc`` to the error file, or warn that there is nowhere to write it.

    ``skip_frames`` drops the outermost traceback entries (the decorator's own wrapper),
    so the recorded traceback starts at the user's function. Never raises: failing to
    record must not replace the user's exception.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        log.warning(
            "%s is not set: %s is not recorded (run under `elastic run` to collect it)",
            ERROR_FILE_ENV,
            type(exc).__name__,
        )
        return
    try:
        from elastic.core.workers.errorfile import write_error_file

        trace = exc.__traceback__
        for _ in range(skip_frames):
            if trace is not None and trace.tb_next is not None:
                trace = trace.tb_next
        write_error_file(path, exc, trace)
    except Exception as write_exc:
        log.warning(
            "could not write error file %s: %s: %s", path, type(write_exc).__name__, write_exc
        )


def record(fn: Callable[..., _R]) -> Callable[..., _R | None]:
    """Record uncaught exceptions of ``fn`` for the agent, then re-raise them.

    Use it once per worker, on the top-level function::

        @elastic.record
        def main() -> None: ...

    Nothing is written when ``fn`` returns. ``sys.exit(0)`` returns None (as torch does, so
    ``runpy``-started entry points end cleanly); another ``SystemExit`` is re-raised
    unrecorded unless it carries a message, which is recorded like an exception.
    ``KeyboardInterrupt`` is not an error of the program and is only re-raised.
    """

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> _R | None:
        _enable_faulthandler()
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code == 0:
                return None
            if exc.code is not None and not isinstance(exc.code, int):
                # sys.exit("message"): the message is the error
                record_exception(exc, skip_frames=1)
            raise
        except Exception as exc:
            record_exception(exc, skip_frames=1)
            raise

    return wrapper
