"""A member's end of presence (``core/rendezvous/round/presence_client.py``): a serving
rank that died after it joined the round, before the member connected, is found by its
refused port at once, as a closed connection is. Real sockets on loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from elastic.core.rendezvous.round.presence import BLIP_GRACE, PresenceServer, hello_line
from elastic.core.rendezvous.round.presence_client import PresenceClient

RUN = "job"


def client_of(port: int, gone: threading.Event) -> PresenceClient:
    return PresenceClient(
        "127.0.0.1", port, lambda nonce: hello_line(None, RUN, "m1", 1, nonce), on_gone=gone.set
    )


def closed_port() -> int:
    """A loopback port nothing listens on (its host refuses a connect there)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(30)
def test_a_serving_rank_refusing_from_the_first_connect_is_gone() -> None:
    gone = threading.Event()
    started = time.monotonic()
    client = client_of(closed_port(), gone)
    try:
        assert gone.wait(5), "a port refused from the start was never taken for a death"
        took = time.monotonic() - started
        assert BLIP_GRACE * 0.9 <= took < BLIP_GRACE + 1.0, took  # the same grace as a close
    finally:
        client.stop()


@pytest.mark.timeout(30)
def test_a_serving_rank_that_listens_is_not_gone() -> None:
    server = PresenceServer("127.0.0.1", None, RUN)
    server.watch(["m1"], 1)
    gone = threading.Event()
    client = client_of(server.port, gone)
    try:
        time.sleep(BLIP_GRACE + 0.5)
        assert not gone.is_set()
        assert server.silent()[0] == []  # its hello proved it
    finally:
        client.stop()
        server.close()


@pytest.mark.timeout(60)
def test_a_process_s_connections_share_one_thread_and_a_failing_callback_ends_only_its_own() -> (
    None
):
    """Every presence connection of a process is served by one thread (a thousand
    handlers in one process made a thousand threads the instant their round formed);
    a member's callback that raises ends its own connection, not that thread."""
    n = 64
    server = PresenceServer("127.0.0.1", None, RUN)
    members = [f"m{i}" for i in range(n)]
    server.watch(members, 1)
    before = {t.ident for t in threading.enumerate()}
    clients = [
        PresenceClient(
            "127.0.0.1",
            server.port,
            lambda nonce, m=m: hello_line(None, RUN, m, 1, nonce),
            lambda: None,
        )
        for m in members
    ]
    broken, gone = threading.Event(), threading.Event()

    def fails() -> None:
        broken.set()
        raise RuntimeError("a member's bug")

    bad = client_of(closed_port(), threading.Event())
    bad._on_gone = fails  # its port refuses: the callback runs after BLIP_GRACE
    late: PresenceClient | None = None
    try:
        deadline = time.monotonic() + 10
        while server.silent()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.silent()[0] == []  # every hello arrived
        new = [t for t in threading.enumerate() if t.ident not in before]
        assert [t.name for t in new if "presence-client" in t.name] in (
            [],  # an earlier test of this process started it
            ["rdzv-presence-clients"],
        )
        assert broken.wait(5) and bad.ended.wait(5)
        late = client_of(closed_port(), gone)  # after the failure: the same thread serves it
        assert gone.wait(5), "the thread stopped serving after a callback failed"
    finally:
        for client in clients:
            client.stop()
        if late is not None:
            late.stop()
        deadline = time.monotonic() + 10
        while not all(c.ended.is_set() for c in clients) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(BLIP_GRACE + 0.5)
        assert server.gone() == []  # each said goodbye
        server.close()
    assert all(c.ended.is_set() for c in clients)


@pytest.mark.timeout(30)
def test_a_socket_closed_under_the_thread_does_not_block_the_next_one() -> None:
    """A connection's socket closed from outside (the tests' stand-in for a killed
    process) leaves its descriptor's number in the thread's selector; the next socket
    the kernel gives that number connects as any other."""
    server = PresenceServer("127.0.0.1", None, RUN)
    server.watch(["m1", "m2"], 1)

    def member(name: str) -> PresenceClient:
        return PresenceClient(
            "127.0.0.1",
            server.port,
            lambda nonce: hello_line(None, RUN, name, 1, nonce),
            lambda: None,
        )

    first = member("m1")
    second: PresenceClient | None = None
    try:
        deadline = time.monotonic() + 5
        while first._sock is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first._sock is not None
        number = first._sock.fileno()
        first._sock.close()  # the kernel forgets it; the selector's map does not
        second = member("m2")
        while "m2" in server.silent()[0] and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        assert "m2" not in server.silent()[0], "the next connection never said hello"
        assert second._sock is not None and second._sock.fileno() == number  # the same number
    finally:
        for client in (first, second):
            if client is not None:
                client.stop()
        server.close()


@pytest.mark.timeout(30)
def test_a_serving_rank_s_port_queues_a_whole_round_s_connects() -> None:
    """Every member connects the instant its round forms. With Python's default backlog
    (128) the kernel drops the connects of a larger round beyond it, each retried a
    second later: the port's accept queue holds a round of MAX_CONNECTIONS members (or
    as many as the system allows)."""
    import shutil
    import subprocess
    from pathlib import Path

    from elastic.core.rendezvous.round.presence import MAX_CONNECTIONS

    ss = shutil.which("ss")
    if ss is None:
        pytest.skip("needs ss (iproute2)")
    server = PresenceServer("127.0.0.1", None, RUN)
    try:
        out = subprocess.run(
            [ss, "-Hltn", f"sport = :{server.port}"], capture_output=True, text=True, check=True
        ).stdout.split()
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        assert out[0] == "LISTEN" and int(out[2]) == min(MAX_CONNECTIONS, somaxconn), out
    finally:
        server.close()
