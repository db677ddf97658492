"""The agent loop's pulse, read by liveness (``/healthz``, ``core/watchdog/health.py``).

The loop is stamped each time it enters or leaves a bounded wait (``SignalGuard.waiting``:
the rendezvous, bounded by its ``join_timeout``; the exit barrier, by its timeout; the
monitor's sleep between two ticks). Every step between two waits is bounded too: store
calls by the handler's fencing, stopping workers by ``--shutdown-timeout``, a checkpoint
on a notice by ``--preemption-grace``. So a loop that has been outside any wait for
longer than those bounds (plus slack) is stuck: a hook that never returns, a deadlock, a
call with no timeout. Inside a wait it is never stuck: the wait's own deadline ends it.
"""

from __future__ import annotations

import time

SLACK = 60.0  # seconds on top of --shutdown-timeout + --preemption-grace: store calls


def stuck_bound(shutdown_timeout: float, preemption_grace: float) -> float:
    """Seconds outside any wait after which the loop counts as stuck."""
    return shutdown_timeout + preemption_grace + SLACK


class LoopClock:
    """Written by the agent's thread, read by the health endpoint's (plain attributes:
    each read sees one whole value)."""

    def __init__(self) -> None:
        self.stamp = time.monotonic()
        self.waits = 0  # > 0 while the loop is inside a bounded wait

    def enter(self) -> None:
        self.waits += 1
        self.stamp = time.monotonic()

    def leave(self) -> None:
        self.waits = max(self.waits - 1, 0)
        self.stamp = time.monotonic()

    def outside_wait_for(self) -> float:
        """Seconds since the loop left its last wait (0 while it waits)."""
        return 0.0 if self.waits else time.monotonic() - self.stamp
