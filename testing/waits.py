"""Polling until something holds, for tests and benches that watch other processes.

Both functions look once more at the deadline, so a condition that became true while the
last sleep ran is not reported as a timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.1) -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy, for at
    most ``timeout`` s; returns what it returned last (falsy: it timed out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def wait_until(
    predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05
) -> bool:
    """Whether ``predicate`` became true within ``timeout`` s (polled every ``interval``)."""
    return bool(wait_for(predicate, timeout, interval))
