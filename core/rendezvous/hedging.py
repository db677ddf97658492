"""Asking a store of several members (an etcd cluster) within a node's lease: hedged
requests (``first_answer``), their budget (``Budget``) and the timing both etcd backends
give the connections a lease depends on (``member_timing``).

A request still unanswered after ``hedge_after`` s is also sent to every other member,
and the first answer wins; one that fails moves on to the next member at once. A member
that hangs rather than refuses (its link cut, its host frozen) then costs the delay and
no more. A write that reached a follower just before its leader died is worse: the
follower forwarded it to the dead leader, and etcd answers it only at its own request
timeout (~6 s), though the others elect a new leader within one to two election
timeouts; until they notice, every follower does the same with every copy. So while no
answer comes, a fresh copy goes out every ``hedge_after`` (for as long as one copy may
wait), and the first sent after the election is answered. Tried one after the other,
such members would cost a whole attempt each. Only idempotent requests may be hedged
(the caller's to decide).

Hedges are throttled as gRPC throttles its retries: each round of copies costs a token,
each prompt answer gives a tenth of one back, and none is sent while half the tokens are
spent, so a cluster that is slow everywhere (overloaded) is not sent several times the
requests.

Imports nothing of the project's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

TOKENS = 10.0  # gRPC's retry throttling's default


def member_timing(heartbeat_timeout: float) -> tuple[float, float]:
    """(attempt, hedge_after): how long one request of the monitor thread's or the
    keep-alives' connection waits on one member, and after how long it is also sent to
    the others.

    A node's lease runs out a second before heartbeat_timeout (4 s of 5 by default:
    ``round.lease``), so finding another member must take well under that when one of
    three is lost. Hedging after a tenth of heartbeat_timeout (0.5 s) makes that the cost
    of a member that refuses or hangs (its link cut), and the leader's loss costs etcd's
    election (one to two election timeouts: 1-2 s at etcd's default) and as much more at
    most; a third of heartbeat_timeout (at least 1 s) bounds a member's turn when the
    budget allows no hedge."""
    return max(1.0, heartbeat_timeout / 3), heartbeat_timeout / 10


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
    limit: float,
) -> tuple[int, Any]:
    """(member, answer) of the first ``ask`` that returns. ``order[0]`` is asked at once,
    the next member at once when one fails with ``transient``; when none answered within
    ``hedge_after``, every other member; and after each ``hedge_after`` more without an
    answer, the next member in ``order`` again (its first copy may be a write held for a
    leader that died: a new copy goes to the new one), each round if ``budget`` allows
    and for ``limit`` s at most. Any other exception from an ``ask`` is raised as it is;
    ``AllFailed`` once every copy sent failed with ``transient``. Each ``ask`` must end
    within a timeout of its own: the last copies are waited for. Copies still running
    when an answer is returned finish on their own daemon threads."""
    answers: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()

    def run(index: int) -> None:
        try:
            answers.put((index, ask(index), None))
        except BaseException as exc:  # handed to the caller's thread
            answers.put((index, None, exc))

    sent = pending = rounds = 0

    def send(copies: int) -> None:
        nonlocal sent, pending
        for _ in range(copies):
            member = order[sent % len(order)]
            threading.Thread(target=run, args=(member,), name="store-ask", daemon=True).start()
            sent, pending = sent + 1, pending + 1

    failures: list[tuple[int, Exception]] = []
    stop_sending = time.monotonic() + limit
    send(1)
    while True:
        sending = time.monotonic() < stop_sending
        try:  # with nothing more to send, the copies out are waited for (each bounded)
            index, value, exc = answers.get(timeout=hedge_after if sending else None)
        except queue.Empty:
            if budget.spend():
                send(len(order) - 1 if rounds == 0 else 1)
                rounds += 1
            else:
                stop_sending = 0.0  # out of budget: no more copies for this request
            continue
        pending -= 1
        if exc is None:
            if rounds == 0:  # answered within hedge_after
                budget.prompt()
            return index, value
        if not isinstance(exc, transient):
            raise exc
        failures.append((index, exc))
        if sent < len(order):
            send(1)
        elif pending == 0:
            raise AllFailed(failures)
