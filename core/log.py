"""What elastic tells its user goes through one logger: ``logging.getLogger("elastic")``
and its children. Nothing here touches the root logger or calls ``basicConfig``.

Two kinds of records travel on it:

- **Lines** (``say``): what a user of ``elastic run`` reads on stderr (progress, a plugin
  dropped, a stall, the failure summary), each with its exact text, ``elastic: ...``
  prefix included where it has one. A line is sent whatever the loggers' levels are
  (as the ``print`` it replaces was): ``--quiet`` decides about progress lines,
  ``LOGLEVEL`` does not. A handler's level or a filter still applies.
- **Diagnostics** (``log.debug(...)`` etc. on ``getLogger(__name__)``): shown at
  ``LOGLEVEL`` and above, as ``[elastic] LEVEL: message``.

Who shows them is the program's choice, not the library's. The ``elastic`` command
installs a ``StderrHandler`` on the ``elastic`` logger (``cli/main.py``). A program that
uses the library (``elastic_launch``, ``LocalElasticAgent``, a plugin host in a test)
keeps its own logging configuration untouched: records propagate to its handlers as any
library's do. Only while nothing it configured would show them (no handler on the
record's way up, pytest's capturing handlers aside) does ``FALLBACK`` write lines and
warnings to stderr, as ``logging.lastResort`` does for warnings, so a bare script that
configures no logging still sees what ``print`` used to show.
"""

from __future__ import annotations

import logging
import sys
from typing import IO

NAME = "elastic"
LINE = "elastic_line"  # set on a line's record: the formatter writes its message as is
DIAGNOSTIC_FORMAT = "[elastic] %(levelname)s: %(message)s"

LOG = logging.getLogger(NAME)


def say(text: str, level: int = logging.INFO, logger: logging.Logger | None = None) -> None:
    """Send one user-facing line (it may span several lines) to ``logger`` (``elastic``
    or a child), whatever the loggers' levels: lines are output, not diagnostics."""
    target = logger or LOG
    if target.disabled:
        return
    record = target.makeRecord(
        target.name, level, "(elastic)", 0, text, None, None, extra={LINE: True}
    )
    target.handle(record)


class LineFormatter(logging.Formatter):
    """A line as it is; any other record as ``[elastic] LEVEL: message``."""

    def __init__(self) -> None:
        super().__init__(DIAGNOSTIC_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, LINE, False):
            return record.getMessage()
        return super().format(record)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record with one write and a flush to whatever ``sys.stderr`` is at the
    time (so redirection and test capture see it), formatted by ``LineFormatter``."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        logging.Handler.__init__(self, level)  # no stream of its own: see ``stream``
        self.setFormatter(LineFormatter())

    @property
    def stream(self) -> IO[str]:  # type: ignore[override]
        return sys.stderr


def _shows(handler: logging.Handler) -> bool:
    """A handler the program configured (pytest's capturing handlers show nothing)."""
    return handler is not FALLBACK and not type(handler).__module__.startswith("_pytest.")


def configured_for(name: str) -> bool:
    """Whether a record of logger ``name`` meets a handler the program installed."""
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        if any(_shows(h) for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


class Fallback(StderrHandler):
    """Lines and warnings on stderr while the program shows them nowhere else."""

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, LINE, False) and record.levelno < logging.WARNING:
            return
        if configured_for(record.name):
            return
        super().emit(record)


def _fallback() -> Fallback:
    """The one ``Fallback`` on the ``elastic`` logger (a reloaded module reuses it)."""
    for handler in LOG.handlers:
        if type(handler).__name__ == "Fallback" and type(handler).__module__ == __name__:
            return handler  # type: ignore[return-value]
    handler = Fallback()
    LOG.addHandler(handler)
    return handler


FALLBACK = _fallback()
