"""The round monitor's fencing clock, against a real store server: a node fences itself
only when the store leaves its requests unanswered, never because its own thread ran
late (hundreds of agents starting on a few cores)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from elastic.core.round import records as R
from elastic.core.round.monitor import Monitor
from elastic.core.tcpstore import TCPStoreServer
from elastic.core.tcpstore.view import Connection, PrefixStore

HOST = "127.0.0.1"
WHERE = "the test store"


class Relay:
    """A TCP relay in front of a store server; ``freeze()`` stops forwarding while every
    connection stays open: a link that went down with both ends alive."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._frozen = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((HOST, self._target))
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            while self._frozen.is_set():
                time.sleep(0.05)  # hold the bytes: nothing arrives, nothing is closed
            try:
                dst.sendall(data)
            except OSError:
                return

    def freeze(self) -> None:
        self._frozen.set()

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    srv = TCPStoreServer(HOST, 0)
    try:
        yield srv
    finally:
        srv.close()


def member_monitor(port: int, interval: float, timeout: float) -> tuple[Monitor, Connection]:
    """A running monitor of node "b", rank 1 of a formed round with "a"; "a" beats once."""
    conn = Connection(HOST, port, timeout=30.0)
    store = PrefixStore(conn, "job/")
    store.heartbeat(R.hb_key("a"), "1 0")
    monitor = Monitor(store, "b", interval=interval, timeout=timeout)
    monitor.set_round(R.Assignment(round=0, state="formed", members=["a", "b"]), rank=1)
    monitor.start()
    return monitor, conn


@pytest.mark.timeout(60)
def test_ticks_that_run_late_but_are_answered_never_fence(server: TCPStoreServer) -> None:
    # Ticks four times the timeout apart: the way a starved thread looks. The store
    # answers each of them, so this node is still a member.
    monitor, conn = member_monitor(server.port, interval=2.0, timeout=0.5)
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            assert monitor.fenced(WHERE) is None
            time.sleep(0.05)
        assert monitor.error is None
    finally:
        monitor.stop(wait=False)
        conn.close()


@pytest.mark.timeout(60)
def test_a_store_that_stops_answering_fences_within_the_timeout(server: TCPStoreServer) -> None:
    relay = Relay(server.port)
    monitor, conn = member_monitor(relay.port, interval=0.2, timeout=1.0)
    try:
        time.sleep(1.0)
        assert monitor.fenced(WHERE) is None  # answered so far
        relay.freeze()
        frozen_at = time.monotonic()
        while (why := monitor.fenced(WHERE)) is None:
            assert time.monotonic() - frozen_at < 10, "never fenced"
            time.sleep(0.05)
        took = time.monotonic() - frozen_at
        assert 1.0 <= took <= 1.0 + 0.2 + 1.0, took  # timeout, one interval, slack
        assert f"cannot reach the rendezvous store at {WHERE}" in why
        assert "heartbeat_timeout=1s" in why
    finally:
        monitor.stop(wait=False)
        conn.close()
        relay.close()
