"""Waiting for a worker to exit: a wait that ends the moment one does.

The agent's monitor and ``stop_workers`` used to sleep a fixed interval between polls, so
a worker's exit was seen up to that interval late (half of it on average: 50 ms of a
0.1 s ``--monitor-interval``, a third of a standalone restart). A pidfd (Linux 5.3+)
becomes readable when its process exits, so ``ExitWait.wait`` blocks in ``poll`` until
an exit or the timeout, whichever comes first. Where pidfds are not available (another
OS, an old kernel, a pid already reaped) it sleeps the timeout, as before.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Iterable


class ExitWait:
    """Wakes on the exit of any of ``pids``; ``close`` (or ``with``) releases the fds."""

    def __init__(self, pids: Iterable[int]) -> None:
        self._fds: dict[int, int] = {}
        self._poller = select.poll() if hasattr(select, "poll") else None
        if self._poller is None or not hasattr(os, "pidfd_open"):
            return
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone and reaped, or no pidfd support: fall back to sleeping
                self.close()
                return
            self._fds[fd] = pid
            self._poller.register(fd, select.POLLIN)

    def wait(self, timeout: float) -> None:
        """Up to ``timeout`` s, less when a watched process exits meanwhile. A process seen
        exited is no longer watched: the next wait does not return at once for it."""
        if self._poller is None or not self._fds:
            time.sleep(max(timeout, 0))
            return
        ready = self._poller.poll(max(timeout, 0) * 1000)
        for fd, _ in ready:
            self._poller.unregister(fd)
            del self._fds[fd]
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds:
            if self._poller is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._poller.unregister(fd)
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ExitWait:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
