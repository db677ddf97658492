"""The agent's own signals: which it forwards to its workers by default
(``DEFAULT_SIGNALS``, torchrun's ``--signals-to-handle``) and ``SignalGuard``, which turns
them into an orderly stop (``Interrupted``, raised only out of a blocking wait).

May import ``loop_clock`` (the loop's pulse every wait stamps).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
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
        # ``deferring``: (the signal that waits, for how long after it came); its end
        # (monotonic) once it came, and the timer that sends it again then.
        self._defer: tuple[int, float] | None = None
        self._defer_until: float | None = None
        self._timer: threading.Timer | None = None
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
        if self._deferred(signum):
            return
        if self._interruptible:
            self._interruptible = False
            raise Interrupted(signum)

    def _deferred(self, signum: int) -> bool:
        """Whether ``signum`` waits now (``deferring``); the first time, its wait starts."""
        if self._defer is None or self._defer[0] != signum:
            return False
        now = time.monotonic()
        if self._defer_until is None:
            self._defer_until = now + self._defer[1]
            # At the end of the wait the signal comes again, to a wait it may interrupt.
            self._timer = threading.Timer(self._defer[1], os.kill, (os.getpid(), signum))
            self._timer.daemon = True
            self._timer.start()
        return now < self._defer_until

    def check(self) -> None:
        """Raise ``Interrupted`` if a signal arrived since the last wait (one that waits,
        ``deferring``, once its wait is over)."""
        if self.pending is not None and not self._deferred(self.pending):
            raise Interrupted(self.pending)

    @contextlib.contextmanager
    def deferring(self, signum: int, seconds: float) -> Iterator[None]:
        """Within: ``signum`` is remembered, not raised, for up to ``seconds`` after it
        came; then, or at the first wait after the block, it is raised as any other."""
        self._defer, self._defer_until = (signum, seconds), None
        try:
            yield
        finally:
            self._defer, self._defer_until = None, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

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
