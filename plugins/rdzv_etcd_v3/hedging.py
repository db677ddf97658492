"""Hedged requests across etcd's members (``first_answer``), and their budget (``Budget``).

A request still unanswered after ``hedge_after`` s is also sent to every other member,
and the first answer wins; one that fails moves on to the next member at once. A member
that hangs rather than refuses (its link cut, its host frozen) then costs the delay and
no more, and so does a live member holding a write it forwarded to a leader that just
died (etcd keeps such a write until its own request timeout, ~6 s, though the others
elect a new leader within a second); tried one after the other, the two would cost two
whole attempts. Only idempotent requests are hedged (the caller's to decide).

Hedges are throttled as gRPC throttles its retries: each costs a token, each prompt
answer gives a tenth of one back, and none is sent while half the tokens are spent, so a
cluster that is slow everywhere (overloaded) is not sent three times the requests.

Imports nothing of the project's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

TOKENS = 10.0  # gRPC's retry throttling's default


class Budget:
    """Thread-safe: one per client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = TOKENS

    def spend(self) -> bool:
        """Whether one more hedge may go out (its token then spent)."""
        with self._lock:
            if self._tokens <= TOKENS / 2:
                return False
            self._tokens -= 1
            return True

    def prompt(self) -> None:
        """An answer came within ``hedge_after``: a tenth of a token back."""
        with self._lock:
            self._tokens = min(TOKENS, self._tokens + 0.1)


class AllFailed(Exception):
    """Every member asked failed with ``transient``: (member, failure), in order."""

    def __init__(self, failures: list[tuple[int, Exception]]) -> None:
        super().__init__(str(failures[-1][1]))
        self.failures = failures


def first_answer(
    order: list[int],
    ask: Callable[[int], Any],
    hedge_after: float,
    budget: Budget,
    transient: type[Exception],
) -> tuple[int, Any]:
    """(member, answer) of the first of ``order`` whose ``ask`` returns: ``order[0]`` at
    once, the next at once when one fails with ``transient``, every other one once none
    answered within ``hedge_after`` (if ``budget`` allows). Any other exception from an
    ``ask`` is raised as it is; ``AllFailed`` when every member failed with ``transient``.
    Each ``ask`` must end within a timeout of its own: the last ones asked are waited for.
    Asks still running when an answer is returned finish on their own daemon threads."""
    answers: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()

    def run(index: int) -> None:
        try:
            answers.put((index, ask(index), None))
        except BaseException as exc:  # handed to the caller's thread
            answers.put((index, None, exc))

    failures: list[tuple[int, Exception]] = []
    asked, wanted = 0, 1
    hedging = True  # until hedge_after has passed: then once, if the budget allows
    while True:
        while asked < wanted:
            threading.Thread(
                target=run, args=(order[asked],), name="etcd-v3-ask", daemon=True
            ).start()
            asked += 1
        try:
            index, value, exc = answers.get(
                timeout=hedge_after if hedging and asked < len(order) else None
            )
        except queue.Empty:
            hedging = False
            if budget.spend():
                wanted = len(order)
            continue
        if exc is None:
            if hedging:
                budget.prompt()
            return index, value
        if not isinstance(exc, transient):
            raise exc
        failures.append((index, exc))
        if len(failures) == len(order):
            raise AllFailed(failures)
        wanted = max(wanted, min(asked + 1, len(order)))
