"""The agent's monitor loop (``core/agent/monitor.watch_attempt``) with real worker
processes: a worker's exit ends the attempt at once, not at the next interval, and once
this node's share of a coordinated checkpoint is counted, the saving node's departure is
read from the store each interval instead of waiting for the handler's cached list."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from elastic.core.agent.monitor import watch_attempt
from elastic.core.agent.outcome import Outcome
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.harness.worker_specs import SleepingWorker

LONG = 30.0  # a monitor interval only an event can cut short


class Job:
    """A ``JobWatch`` with nothing to say but a pending checkpoint request."""

    def __init__(self, checkpoint_requested: bool = False) -> None:
        self.error = None
        self.failed = self.peer_failed = self.finished = False
        self.checkpoint_requested = checkpoint_requested

    def refresh(self) -> None:
        pass  # nothing cached to take

    def stop(self) -> None:
        pass


class DepartureHandler(LocalRendezvousHandler):
    """Its cached list never names anyone; the store (``membership_changed``) says a
    member left."""

    def __init__(self) -> None:
        super().__init__("watch", "127.0.0.1")
        self.asked = 0

    def membership_changed(self) -> bool:
        self.asked += 1
        return True


def sleep(seconds: float, wait: Callable[[float], object] = time.sleep) -> None:
    wait(seconds)


def watch(worker: SleepingWorker, handler: DepartureHandler, **kw: Any) -> tuple[Outcome, float]:
    started = time.monotonic()
    end = watch_attempt(
        [worker],  # type: ignore[list-item]
        Job(kw.pop("requested", False)),  # type: ignore[arg-type]
        sleep=sleep,
        handler=handler,
        check_plugins=lambda workers: None,
        **kw,
    )
    return end.outcome, time.monotonic() - started


def test_a_worker_exit_ends_the_attempt_before_the_interval() -> None:
    worker = SleepingWorker(0.2, code=3)
    try:
        outcome, took = watch(worker, DepartureHandler(), interval=LONG, relay_checkpoint=None)
    finally:
        worker.kill()
    assert outcome is Outcome.FAILED
    assert took < LONG / 2, f"the exit was seen after {took:.1f}s"


@pytest.mark.parametrize("requested", [True, False])
def test_once_the_save_is_counted_the_departure_is_read_from_the_store(requested: bool) -> None:
    """Requested through the job's keys or heard of by the workers first: either way."""
    handler, worker = DepartureHandler(), SleepingWorker(LONG)
    try:
        outcome, _ = watch(
            worker,
            handler,
            interval=0.05,
            relay_checkpoint=lambda: True,
            checkpoint_saved=lambda: not requested,
            requested=requested,
        )
    finally:
        worker.kill()
    assert outcome is Outcome.LOST_NODE
    assert handler.asked >= 1


def test_before_the_save_is_counted_the_store_is_not_asked() -> None:
    handler, worker = DepartureHandler(), SleepingWorker(0.5)
    try:
        outcome, _ = watch(
            worker,
            handler,
            interval=0.05,
            relay_checkpoint=lambda: False,
            checkpoint_saved=lambda: False,
            requested=True,
        )
    finally:
        worker.kill()
    assert outcome is Outcome.SUCCEEDED  # the worker finished; nobody was read as gone
    assert handler.asked == 0
