"""A fenced node's workers stop without the agent's main loop: the round monitor tells
the moment it fences (its lease's judge, or a tick that finds it published lost), and the
agent's ``FenceGuard`` signals the workers from that thread and SIGKILLs them after the
grace (``core/agent/fence.py``). Real processes and a real store server on loopback."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from elastic.core.agent.fence import FenceGuard
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.lease import STOP_MARGIN
from elastic.core.rendezvous.round.liveness import add_lost
from elastic.core.rendezvous.round.monitor import Monitor
from elastic.core.tcpstore import TCPStoreServer
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.core.workers.process import CommandWorker, peek_exit

# Ignores SIGTERM: only the SIGKILL ends it (a worker stuck in a collective).
STUCK = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"


@pytest.fixture
def stuck() -> Iterator[list[CommandWorker]]:
    workers = [CommandWorker(i, [sys.executable, "-c", STUCK], {}) for i in range(2)]
    time.sleep(0.3)  # the SIGTERM handler is in place
    yield workers
    for w in workers:
        if w.poll() is None:
            w.proc.kill()
        w.reap(5)


def exited_within(workers: list[CommandWorker], seconds: float) -> float | None:
    """When every worker exited (s from now), or None if one runs after ``seconds``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if all(peek_exit(w.pid) is not None for w in workers):
            return time.monotonic() - t0
        time.sleep(0.005)
    return None


def test_a_fencing_kills_the_round_s_workers_after_the_grace(stuck: list[CommandWorker]) -> None:
    guard = FenceGuard()
    guard.watch(stuck, 4)
    guard.fenced(3, 0.1)  # an older round's fencing: nothing to do with these
    assert exited_within(stuck, 0.5) is None
    t0 = time.monotonic()
    threading.Thread(target=guard.fenced, args=(4, 0.3)).start()  # the handler's thread
    took = exited_within(stuck, 5.0)
    assert took is not None and 0.25 <= time.monotonic() - t0 <= 1.0, took
    assert all(w.poll() == -signal.SIGKILL for w in stuck)


def test_released_workers_are_the_agent_s_but_the_grace_does_not_grow(
    stuck: list[CommandWorker],
) -> None:
    guard = FenceGuard()
    guard.watch(stuck, 0)
    assert guard.release(30.0) == 30.0  # not fenced: the agent's own grace
    guard.watch(stuck, 1)
    guard.fenced(1, 0.5)
    left = guard.release(30.0)  # the agent takes over: at most what is left of 0.5 s
    assert 0.0 < left <= 0.5
    assert exited_within(stuck, 1.0) is None  # the guard's SIGKILL is off: the agent reaps


def test_fenced_before_the_workers_were_handed_over_stops_them_at_once(
    stuck: list[CommandWorker],
) -> None:
    guard = FenceGuard()
    guard.fenced(7, 0.3)
    guard.watch(stuck, 7)
    assert exited_within(stuck, 1.0) is not None


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    srv = TCPStoreServer("127.0.0.1", 0)
    try:
        yield srv
    finally:
        srv.close()


def member(port: int, timeout: float) -> tuple[Monitor, list[tuple[int, float, float]]]:
    """Node "b", rank 1 of round 5 with "a"; records (round, grace, when) of each fencing."""
    store = PrefixStore(Connection("127.0.0.1", port, timeout=30.0), "job/")
    store.heartbeat("rdzv/" + R.hb_key("a"), "1 0")
    monitor = Monitor(store, "b", interval=0.2, timeout=timeout)
    told: list[tuple[int, float, float]] = []
    monitor.on_fenced = lambda rnd, grace: told.append((rnd, grace, time.monotonic()))
    monitor.start()
    monitor.set_round(R.Assignment(round=5, state="formed", size=2, first="a"), rank=1)
    return monitor, told


@pytest.mark.timeout(60)
def test_the_lease_s_end_is_told_at_once_without_anyone_asking(server: TCPStoreServer) -> None:
    monitor, told = member(server.port, timeout=2.0)
    try:
        time.sleep(0.5)
        stopped = time.monotonic()
        monitor.suspend_heartbeats()  # no keep-alive from now on: the lease runs out
        deadline = time.monotonic() + 10
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)  # nobody calls monitor.fenced(): the judge tells by itself
        assert told, "never told"
        rnd, grace, at = told[0]
        length = monitor.lease.length  # 2 s - STOP_MARGIN
        assert rnd == 5 and grace == pytest.approx(STOP_MARGIN / 3)
        assert at - stopped <= length + 0.3, at - stopped
        time.sleep(0.5)
        assert len(told) == 1  # once per round
    finally:
        monitor.stop(wait=False)


@pytest.mark.timeout(60)
def test_published_lost_is_told_on_the_tick_that_reads_it(server: TCPStoreServer) -> None:
    monitor, told = member(server.port, timeout=30.0)
    try:
        time.sleep(0.5)
        store = PrefixStore(Connection("127.0.0.1", server.port, timeout=30.0), "job/rdzv/")
        add_lost(store, 5, ["b"])
        published = time.monotonic()
        deadline = time.monotonic() + 5
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)
        assert told and told[0][0] == 5
        assert told[0][2] - published <= 0.2 + 0.3  # within a tick
    finally:
        monitor.stop(wait=False)


def test_the_guard_leaves_no_process_when_the_agent_never_asks() -> None:
    """End to end in one process: a monitor whose lease runs out and a guard, wired as
    the agent wires them; nobody polls, the worker is SIGKILLed."""
    srv = TCPStoreServer("127.0.0.1", 0)
    worker = CommandWorker(0, [sys.executable, "-c", STUCK], {})
    try:
        time.sleep(0.3)
        monitor, _ = member(srv.port, timeout=2.0)
        guard = FenceGuard()
        monitor.on_fenced = guard.fenced
        guard.watch([worker], 5)
        time.sleep(0.3)
        monitor.suspend_heartbeats()
        assert exited_within([worker], 6.0) is not None
        monitor.stop(wait=False)
    finally:
        if worker.poll() is None:
            worker.proc.kill()
        worker.reap(5)
        srv.close()
