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
