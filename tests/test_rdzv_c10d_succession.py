"""The c10d store's succession (``plugins/rdzv_c10d/succession.py``): it moves whenever its
holder leaves, to a standby that is not leaving, carrying the run's identity; a write
under way while it moves is applied once or fails to its sender. Real handlers and
servers on loopback, handlers as threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStoreGoneError,
    RendezvousStoreMovedError,
)
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.harness.c10d_handlers import Make, c10d_handlers, rendezvous_all
from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler
from elastic.plugins.rdzv_c10d.handover import copy_into, mark_leaving, next_generation, offer
from elastic.plugins.rdzv_c10d.succession import (
    IDLE,
    LEAVING,
    PROBE_TIMEOUT,
    STANDBY_KEY,
    Succession,
    identity_key,
    new_identity,
    parse_identity,
    wire_key,
)
from elastic.testing.conformance import round_members
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until


@pytest.fixture
def make(port: int) -> Iterator[Make]:
    with c10d_handlers(port, default_max=4) as factory:
        yield factory


def holder(handlers: list[C10dRendezvousHandler]) -> C10dRendezvousHandler:
    hosting = [h for h in handlers if h.is_hosting]
    assert len(hosting) == 1, [h.is_hosting for h in handlers]
    return hosting[0]


def generation(handler: C10dRendezvousHandler) -> int:
    known = handler._succession.known
    assert known is not None
    return known[0]


def test_the_store_moves_as_often_as_its_holders_leave(make: Make) -> None:
    """Four nodes; the first host leaves, then the member that took the store, then the
    next: each time the rest regroup on the moved store, one generation on."""
    handlers = [make(1, 4) for _ in range(4)]
    infos = rendezvous_all(handlers)
    rnd = infos[0].round
    for moves in range(1, 4):
        leaving = holder(handlers)
        handlers.remove(leaving)
        leaving.leave()
        assert wait_until(lambda: any(h.is_hosting for h in handlers), 5)
        again = rendezvous_all(handlers)
        assert {i.world_size for i in again} == {len(handlers)}
        assert leaving.node_id not in round_members(handlers[0], again[0])
        assert again[0].round > rnd
        rnd = again[0].round
        assert {generation(h) for h in handlers} == {moves}
        leaving.shutdown()
    assert holder(handlers) is handlers[0]


def test_a_holder_between_rounds_hands_the_store_over(make: Make) -> None:
    """The host leaves while it waits in a regroup (no current round): the store still
    moves, and the survivor forms the next round on it. (An agent's regroup is unwound
    by the signal before it leaves; here the host's thread runs on until join_timeout.)"""
    handlers = [make(1, 3, last_call_timeout="30", join_timeout="8") for _ in range(3)]
    rendezvous_all(handlers)
    host = holder(handlers)
    gone, survivor = [h for h in handlers if h is not host]
    gone.leave()  # the host regroups, waiting for the survivor, who is not back yet
    pool = ThreadPoolExecutor(1)
    regroup = pool.submit(host.next_rendezvous)
    assert wait_until(lambda: host._current is None, 5)
    time.sleep(0.3)
    host.leave()
    assert wait_until(lambda: survivor.is_hosting, 5)
    (info,) = rendezvous_all([survivor])
    assert info.world_size == 1 and generation(survivor) == 1
    host.shutdown()
    with pytest.raises(RendezvousError):
        regroup.result(timeout=30)
    pool.shutdown()


def test_a_leaving_standby_is_never_chosen(make: Make) -> None:
    """The first successor in rank order leaves just before the host: the store goes to
    the next standby, never to the leaving one."""
    handlers = [make(1, 3) for _ in range(3)]
    infos = rendezvous_all(handlers)
    host = holder(handlers)
    by_rank = sorted(zip(infos, handlers, strict=True), key=lambda p: p[0].rank)
    first, second = [h for _, h in by_rank if h is not host]
    first._succession.known = None  # irrelevant here; the mark decides
    first.leave()
    assert first._own_mark == LEAVING
    host.leave()
    assert wait_until(lambda: second.is_hosting, 5)
    assert not first.is_hosting


@pytest.mark.parametrize("trial", range(5))
def test_a_holder_and_a_standby_leaving_at_once_keep_the_store(make: Make, trial: int) -> None:
    """The host and its first successor leave at the same moment: whichever way the two
    compare_sets on the successor's mark go, the third node ends up holding the store
    (directly, or from the successor, which received it and handed it on)."""
    handlers = [make(1, 3) for _ in range(3)]
    infos = rendezvous_all(handlers)
    host = holder(handlers)
    first, second = [
        h for _, h in sorted(zip(infos, handlers, strict=True), key=_rank) if h is not host
    ]
    barrier = threading.Barrier(2)

    def leave(h: C10dRendezvousHandler) -> None:
        barrier.wait()
        time.sleep(0.001 * trial)
        h.leave()

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(leave, [host, first]))
    assert wait_until(lambda: second.is_hosting, 15)
    assert not first.is_hosting and not host.is_hosting
    (info,) = rendezvous_all([second])
    assert info.world_size == 1


def _rank(pair: tuple[Any, C10dRendezvousHandler]) -> int:
    return int(pair[0].rank)


def test_a_store_opened_anew_at_the_first_endpoint_is_refused(make: Make, port: int) -> None:
    """After the move, something serves the first endpoint again (a replacement agent's
    new store, which names itself generation 0): a survivor's connection made there is
    refused and finds the moved store instead."""
    handlers = [make(1, 2) for _ in range(2)]
    rendezvous_all(handlers)
    host = holder(handlers)
    survivor = next(h for h in handlers if h is not host)
    host.leave()
    assert wait_until(lambda: survivor.is_hosting, 5)
    host.shutdown()
    anew = TCPStoreServer("127.0.0.1", port)
    try:
        fresh = TCPStoreClient("127.0.0.1", port, 5.0)
        fresh.compare_set(identity_key("job"), "", new_identity(0))
        with pytest.raises(RendezvousStoreGoneError, match="not run 'job'"):
            survivor._succession.accept(fresh)
        conn = Connection("127.0.0.1", port, 5.0)
        conn.locator = survivor._succession
        conn.call("check", ["x"])  # refused there, found at the survivor's
        assert conn.where == survivor.protocol.node["standby"]
        conn.close()
        fresh.close()
    finally:
        anew.close()


class Move:
    """A store and a standby with the run's identity, and a connection whose locator
    knows the standby: the pieces of a handover, driven step by step."""

    def __init__(self) -> None:
        self.old = TCPStoreServer("127.0.0.1", 0, data={wire_key(identity_key("job")): b"0 a"})
        standby_port = free_port()
        self.standby = TCPStoreServer("127.0.0.1", standby_port, data={wire_key(STANDBY_KEY): IDLE})
        self.succession = Succession("job", [("127.0.0.1", self.old.port)], None)
        self.succession.successors = [("127.0.0.1", standby_port)]
        self.succession.learn(b"0 a")
        self.conn = Connection("127.0.0.1", self.old.port, 5.0)
        self.conn.locator = self.succession
        self.conn.call("check", ["warm"])  # connected before the move

    def move_while_the_old_loop_is_busy(self) -> threading.Thread:
        """Hold the old store's loop for 0.5 s (a request sent now waits in its
        socket); meanwhile mark the standby receiving and stop the old store, so the
        loop ends without reading that request; then copy."""

        def hand_over() -> None:
            time.sleep(0.2)
            client = offer(f"127.0.0.1:{self.standby.port}", "sender", 5.0, None)
            assert client is not None
            data = next_generation(self.old.close_and_take(), "job")
            copy_into(client, data)
            client.close()

        busy = threading.Thread(target=self.old._in_loop, args=(lambda: time.sleep(0.5),))
        busy.start()
        mover = threading.Thread(target=hand_over)
        mover.start()
        time.sleep(0.05)
        return mover

    def close(self) -> None:
        self.conn.close()
        self.old.close()
        self.standby.close()


def test_a_set_sent_while_the_store_moves_is_applied_at_the_new_store() -> None:
    move = Move()
    try:
        view = PrefixStore(move.conn, "p/")  # made before the move, as the round's are
        mover = move.move_while_the_old_loop_is_busy()
        move.conn.call("set", "k", b"v")  # sent to the old store, which never reads it
        mover.join()
        assert move.conn.where == f"127.0.0.1:{move.standby.port}"
        assert view.where == move.conn.where  # messages name the store where it is now
        # the client found by probing (2 s) carries the connection's own timeout now
        assert move.conn._current().timeout == 5.0
        with TCPStoreClient("127.0.0.1", move.standby.port, 5.0) as check:
            assert check.multi_get(["k"], False) == [b"v"]
            raw = check.multi_get([identity_key("job")], False)[0]
        identity = parse_identity(raw)
        assert identity is not None and identity[0] == 1
        assert move.succession.known == identity
    finally:
        move.close()


def test_an_add_whose_answer_is_lost_in_a_move_fails_to_its_sender() -> None:
    move = Move()
    try:
        mover = move.move_while_the_old_loop_is_busy()
        with pytest.raises(RendezvousConnectionError, match="during a ADD") as err:
            move.conn.call("add", "count", 1)
        assert not isinstance(err.value, RendezvousStoreGoneError)  # not final: retried
        assert isinstance(err.value, RendezvousStoreMovedError)  # the agent rejoins on it
        mover.join()
        with TCPStoreClient("127.0.0.1", move.standby.port, 5.0) as check:
            assert check.multi_get(["count"], False) == [b""]  # never applied
        assert move.conn.call("add", "count", 1) == 1  # the caller's retry counts once
    finally:
        move.close()


def race_once() -> tuple[TCPStoreClient | None, bytes]:
    """A holder offering the store and the standby's own agent leaving, from two threads
    released together: (the offer's client or None, the mark ``mark_leaving`` saw)."""
    standby = TCPStoreServer("127.0.0.1", 0, data={wire_key(STANDBY_KEY): IDLE})
    barrier = threading.Barrier(2)
    results: dict[str, Any] = {}

    def offering() -> None:
        barrier.wait()
        results["offer"] = offer(f"127.0.0.1:{standby.port}", "h", 5.0, None)

    def leaving() -> None:
        barrier.wait()
        results["leave"] = mark_leaving(("127.0.0.1", standby.port), None)

    threads = [threading.Thread(target=offering), threading.Thread(target=leaving)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    standby.close()
    return results["offer"], results["leave"]


def test_offer_and_leaving_race_on_one_mark() -> None:
    """Exactly one of the two compare_sets wins, every time."""
    for _ in range(20):
        client, mark = race_once()
        assert (client is not None) != (mark == LEAVING)
        if client is not None:
            assert mark.startswith(b"receiving")
            client.close()


def test_a_candidate_receiving_the_store_keeps_the_first_endpoint_closed() -> None:
    """An agent that could host the first endpoint looks at the other candidates first:
    one receiving the run's store, or serving it, means the run has one already."""
    receiving = TCPStoreServer("127.0.0.1", 0, data={wire_key(STANDBY_KEY): b"receiving x"})
    other_run = TCPStoreServer("127.0.0.1", 0, data={wire_key(identity_key("other")): b"3 b"})
    try:
        mine = Succession("job", [("127.0.0.1", 1), ("127.0.0.1", receiving.port)], None)
        assert mine.serving_elsewhere()
        elsewhere = Succession("job", [("127.0.0.1", 1), ("127.0.0.1", other_run.port)], None)
        assert not elsewhere.serving_elsewhere()  # another run's store is not ours
    finally:
        receiving.close()
        other_run.close()


def test_a_handover_that_never_ends_is_a_lost_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender died mid-copy: its successor stays marked receiving, is waited for
    ``HANDOVER_WAIT`` and never used; the store is then lost, said as such (the agent's
    one line), not taken for a partition."""
    from elastic.plugins.rdzv_c10d import succession

    monkeypatch.setattr(succession, "HANDOVER_WAIT", 1.0)
    stuck = TCPStoreServer(
        "127.0.0.1",
        0,
        data={wire_key(STANDBY_KEY): b"receiving gone", wire_key(identity_key("job")): b"1 n"},
    )
    old = TCPStoreServer("127.0.0.1", 0, data={wire_key(identity_key("job")): b"0 a"})
    mine = Succession("job", [("127.0.0.1", old.port)], None)
    mine.successors = [("127.0.0.1", stuck.port)]
    mine.learn(b"0 a")
    conn = Connection("127.0.0.1", old.port, 5.0, gone_hint="HINT")
    conn.locator = mine
    try:
        conn.call("check", ["x"])
        old.close()  # its host died after marking the successor
        started = time.monotonic()
        with pytest.raises(RendezvousStoreGoneError, match="HINT"):
            conn.call("check", ["x"])
        assert 1.0 <= time.monotonic() - started < 5.0
        assert conn.where == f"127.0.0.1:{old.port}"  # never moved to the half copy
    finally:
        conn.close()
        stuck.close()


def test_a_moved_store_is_taken_only_with_the_run_s_identity_and_the_newest() -> None:
    """Among the successors: another run's store and an older one of this run are never
    taken; of this run's, the highest generation is; the same generation under another
    nonce (a second store that named itself alike) is refused."""
    key = wire_key(identity_key("job"))
    servers = {
        "other run": TCPStoreServer("127.0.0.1", 0, data={wire_key(identity_key("x")): b"9 z"}),
        "older": TCPStoreServer("127.0.0.1", 0, data={key: b"1 a"}),
        "newest": TCPStoreServer("127.0.0.1", 0, data={key: b"3 c"}),
        "newer": TCPStoreServer("127.0.0.1", 0, data={key: b"2 b"}),
    }
    gone = TCPStoreServer("127.0.0.1", 0)
    conn = Connection("127.0.0.1", gone.port, 5.0)
    try:
        mine = Succession("job", [("127.0.0.1", 1)], None)
        mine.successors = [("127.0.0.1", s.port) for s in servers.values()]
        mine.learn(b"2 b")
        found = mine.find(conn)
        assert found is not None
        assert found[1] == servers["newest"].port and mine.known == (3, "c")
        found[2].close()
        alike = TCPStoreServer("127.0.0.1", 0, data={key: b"3 other"})
        mine.successors = [("127.0.0.1", alike.port), ("127.0.0.1", servers["older"].port)]
        assert mine.find(conn) is None  # neither is the store this node knows
        with TCPStoreClient("127.0.0.1", alike.port, 5.0) as client:
            with pytest.raises(RendezvousStoreGoneError):
                mine.accept(client)
        alike.close()
    finally:
        conn.close()
        gone.close()
        for server in servers.values():
            server.close()


def test_a_cut_off_successor_does_not_delay_finding_the_moved_store() -> None:
    """A successor that accepts connections and never answers (its host cut off) holds
    up only its own probe: the store that moved is found at once, not after PROBE_TIMEOUT
    (probed one after another, each pass waited for it, past the members' 4 s lease)."""
    import socket

    key = wire_key(identity_key("job"))
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    moved = TCPStoreServer("127.0.0.1", 0, data={key: b"1 b"})
    gone = TCPStoreServer("127.0.0.1", 0)
    conn = Connection("127.0.0.1", gone.port, 5.0)
    try:
        mine = Succession("job", [("127.0.0.1", 1)], None)
        mine.successors = [("127.0.0.1", silent.getsockname()[1]), ("127.0.0.1", moved.port)]
        mine.learn(b"0 a")
        started = time.monotonic()
        found = mine.find(conn)
        took = time.monotonic() - started
        assert found is not None and found[1] == moved.port, found
        found[2].close()
        assert took < PROBE_TIMEOUT / 2, took
    finally:
        conn.close()
        gone.close()
        moved.close()
        silent.close()
