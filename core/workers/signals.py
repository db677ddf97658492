"""The agent's own signals: which it forwards to its workers by default
(``DEFAULT_SIGNALS``, torchrun's ``--signals-to-handle``) and ``SignalGuard``, which turns
them into an orderly stop (``Interrupted``, raised only out of a blocking wait).

May import ``loop_clock`` (the loop's pulse every wait stamps).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from elastic.core.workers.loop_clock import LoopClock

# What the agent forwards to its workers by default (torchrun's --signals-to-handle).
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class Interrupted(BaseException):
    """Raised out of a blocking wait when the agent got a signal. A BaseException so a
    rendezvous backend's ``except Exception`` cannot swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalGuard:
    """Turns the signals the agent handles into an orderly stop.

    A signal only raises ``Interrupted`` while the agent is in a blocking wait (a
    rendezvous, the monitor's sleep); anywhere else (starting or stopping workers,
    writing the store) it is remembered and raised at the next wait, so no half-done
    step is left behind.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.pending: int | None = None
        self._interruptible = False
        self._saved: dict[int, Any] = {}
        self.clock = LoopClock()  # the loop's pulse: every wait stamps it (liveness)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works there; the caller owns signals then
        for name in self.names:
            signum = getattr(signal, name.strip(), None)
            if isinstance(signum, int):
                with contextlib.suppress(ValueError, OSError):
                    self._saved[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.pending is None:
            self.pending = signum
        if self._interruptible:
            self._interruptible = False
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise ``Interrupted`` if a signal arrived since the last wait."""
        if self.pending is not None:
            raise Interrupted(self.pending)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A blocking wait that a signal may interrupt."""
        self._interruptible = True
        self.clock.enter()
        try:
            self.check()
            yield
        finally:
            self._interruptible = False
            self.clock.leave()
