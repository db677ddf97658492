"""``JUDGES``: one thread per process that runs every lease's judge when it is due.

A lease's judge (``lease.py``) sleeps until the lease's end and then decides; it never
waits for the store (it reads only the lease's own state and a socket option). One thread
can therefore judge every lease of a process without one delaying another. A real agent
has one lease; the rendezvous benchmark runs a thousand handlers in one process, where a
judge thread apiece cost a thousand thread starts inside the round and as many sleepers.

Each judge is a ``step(now) -> due``: judge at ``now`` (monotonic), return when to judge
again (monotonic), or None to sleep until ``wake``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Step = Callable[[float], float | None]


class Judges:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._steps: dict[object, Step] = {}
        # The one heap entry of a judge that counts (others are stale: woken since).
        self._due: dict[object, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, object]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, key: object, step: Step) -> None:
        """Judge ``key`` with ``step`` from now on, first at once."""
        with self._cond:
            self._steps[key] = step
            self._schedule(key, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rdzv-lease", daemon=True)
                self._thread.start()

    def wake(self, key: object) -> None:
        """Judge ``key`` now (its state changed: armed, stopped)."""
        self.plan(key, time.monotonic())

    def plan(self, key: object, at: float | None) -> None:
        """Judge ``key`` at ``at`` (monotonic), whatever was planned before; None: not
        until it is woken. A judge whose owner knows when it is next due is planned for
        then, and the thread is woken only if that comes before everything else it waits
        for: a thousand leases of one process armed together wake it once, not a
        thousand times."""
        with self._cond:
            if key not in self._steps:
                return
            if at is None:
                self._due.pop(key, None)
            else:
                self._schedule(key, at)

    def remove(self, key: object) -> None:
        with self._cond:
            self._steps.pop(key, None)
            self._due.pop(key, None)

    def _schedule(self, key: object, at: float) -> None:
        """Caller holds ``_cond``. The thread sleeps until the heap's first entry (or
        later, the heap empty), so only a new first entry needs to wake it."""
        entry = (at, next(self._seq))
        self._due[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if self._heap[0][1] == entry[1]:
            self._cond.notify()

    def _next(self) -> tuple[object, Step, tuple[float, int]]:
        """Wait for the earliest due judge; caller holds ``_cond``."""
        while True:
            while self._heap and self._due.get(self._heap[0][2]) != self._heap[0][:2]:
                heapq.heappop(self._heap)  # stale: woken or removed since
            if not self._heap:
                self._cond.wait()
                continue
            at, seq, key = self._heap[0]
            pause = at - time.monotonic()
            if pause > 0:
                self._cond.wait(pause)
                continue
            heapq.heappop(self._heap)
            return key, self._steps[key], (at, seq)

    def _run(self) -> None:
        while True:
            with self._cond:
                key, step, entry = self._next()
            try:
                due = step(time.monotonic())
            except Exception:  # a bug in one judge must not stop the others'
                log.exception("lease judge failed")
                due = None
            with self._cond:
                if self._due.get(key) == entry:  # not woken or removed meanwhile
                    if due is None:
                        del self._due[key]
                    else:
                        self._schedule(key, due)

    def _after_fork(self) -> None:
        """A forked child has none of the parent's threads: start afresh."""
        self.__init__()  # type: ignore[misc]


JUDGES = Judges()
os.register_at_fork(after_in_child=JUDGES._after_fork)
