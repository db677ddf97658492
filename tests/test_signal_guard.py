"""The agent's signal guard (``core/workers/signals.py``), with real signals sent to this
process: a signal raises ``Interrupted`` out of a blocking wait; one the agent defers
(``deferring``: a preemption notice while the job re-forms) waits until the block ends or
its time is up, whichever is first, and is raised at the next wait then."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from elastic.core.workers.signals import Interrupted, SignalGuard


@pytest.fixture
def guard() -> Iterator[SignalGuard]:
    made = SignalGuard(["SIGUSR1", "SIGUSR2"])
    made.install()
    yield made
    made.restore()


def wait_in(guard: SignalGuard, seconds: float) -> float | None:
    """Wait ``seconds`` in a wait a signal may interrupt; when it was, after how long."""
    start = time.monotonic()
    try:
        with guard.waiting():
            while time.monotonic() - start < seconds:
                time.sleep(0.01)
    except Interrupted:
        return time.monotonic() - start
    return None


@pytest.mark.timeout(30)
def test_a_signal_interrupts_a_wait(guard: SignalGuard) -> None:
    os.kill(os.getpid(), signal.SIGUSR1)
    assert wait_in(guard, 0.5) is not None


@pytest.mark.timeout(30)
def test_a_deferred_signal_waits_for_the_block_and_is_raised_at_the_next_wait(
    guard: SignalGuard,
) -> None:
    with guard.deferring(signal.SIGUSR1, 10.0):
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_in(guard, 0.5) is None  # remembered, not raised
        guard.check()  # nor here
    assert guard.pending == signal.SIGUSR1
    with pytest.raises(Interrupted):
        guard.check()


@pytest.mark.timeout(30)
def test_a_deferred_signal_is_raised_when_its_time_is_up(guard: SignalGuard) -> None:
    with guard.deferring(signal.SIGUSR1, 0.4):
        time.sleep(0.3)  # its time counts from when it came, not from the block's start
        sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)
        took = wait_in(guard, 5.0)
        assert took is not None, "never raised"
        assert 0.35 <= time.monotonic() - sent < 1.5


@pytest.mark.timeout(30)
def test_only_the_deferred_signal_waits(guard: SignalGuard) -> None:
    with guard.deferring(signal.SIGUSR1, 10.0):
        os.kill(os.getpid(), signal.SIGUSR2)
        assert wait_in(guard, 0.5) is not None
