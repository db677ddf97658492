"""The process's judge thread (``judges.Judges``): a judge runs when planned, not before,
not after; a plan replaces the one before; an earlier plan wakes a thread asleep for a
later one."""

from __future__ import annotations

import threading
import time

import pytest
from elastic.core.rendezvous.round.judges import Judges


class Recorder:
    """A judge's step that notes when it ran and returns ``then()`` (None: no more)."""

    def __init__(self, then: float | None = None) -> None:
        self.runs: list[float] = []
        self.ran = threading.Event()
        self.then = then

    def __call__(self, now: float) -> float | None:
        self.runs.append(time.monotonic())
        self.ran.set()
        return None if self.then is None else time.monotonic() + self.then


def added(judges: Judges, step: Recorder) -> object:
    """``step`` added under a new key, its first run (at once) done and forgotten."""
    key = object()
    judges.add(key, step)
    assert step.ran.wait(2), "a judge added is judged at once"
    step.runs.clear()
    step.ran.clear()
    return key


@pytest.mark.timeout(30)
def test_a_planned_judge_runs_at_its_time_and_not_before() -> None:
    judges = Judges()
    step = Recorder()
    key = added(judges, step)
    at = time.monotonic() + 0.3
    judges.plan(key, at)
    assert step.ran.wait(3)
    assert at <= step.runs[0] <= at + 0.5
    assert len(step.runs) == 1


@pytest.mark.timeout(30)
def test_a_plan_replaces_the_one_before_and_none_cancels_it() -> None:
    judges = Judges()
    step = Recorder()
    key = added(judges, step)
    judges.plan(key, time.monotonic() + 0.1)
    judges.plan(key, None)
    assert not step.ran.wait(0.6), "a cancelled plan still ran"
    judges.plan(key, time.monotonic() + 0.1)
    later = time.monotonic() + 0.5
    judges.plan(key, later)  # the plan for later counts, the earlier one is void
    assert step.ran.wait(3)
    assert step.runs[0] >= later


@pytest.mark.timeout(30)
def test_an_earlier_plan_wakes_a_thread_asleep_for_a_later_one() -> None:
    judges = Judges()
    sleeper = Recorder(then=60.0)  # due again in a minute: the thread sleeps until then
    added(judges, sleeper)
    sleeper.ran.wait(0.2)  # nothing: it is not due
    step = Recorder()
    key = added(judges, step)  # its first run (at once) woke the thread: it sleeps again
    time.sleep(0.1)
    at = time.monotonic() + 0.2
    judges.plan(key, at)
    assert step.ran.wait(3), "the thread slept on until the later judge"
    assert step.runs[0] <= at + 0.5
    assert not sleeper.runs
