"""Rank 0's presence port against a peer on the same network: a hello answers a fresh
challenge of its connection and names the round, so a recorded one proves nothing; a
connection that never proved itself makes nobody lost; a malformed hello costs its own
connection only. A crash is still found in about a second (a closed connection)."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic.core.rendezvous.round import presence
from elastic.core.rendezvous.round.presence import PresenceServer, hello_line
from elastic.harness.c10d_handlers import Make, c10d_handlers, rendezvous_all, write_token_file
from elastic.harness.store_sockets import raw
from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler
from elastic.testing.waits import wait_until

TOKEN = b"the-job-token-of-32-bytes-or-so!"
# A member connects to rank 0 a heartbeat interval after a round forms: 1 s, twice the
# grace a closed connection has to come back (``presence.BLIP_GRACE``).
CONF = {"heartbeat_interval": "1", "heartbeat_timeout": "30", "close_timeout": "3"}
HOST = "127.0.0.1"


def challenge(sock: socket.socket) -> str:
    line = b""
    while not line.endswith(b"\n"):
        chunk = sock.recv(64)
        assert chunk, "the presence port closed before its challenge"
        line += chunk
    return line.strip().decode()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


@pytest.fixture
def port_with_token() -> Iterator[PresenceServer]:
    server = PresenceServer(HOST, TOKEN, "job")
    server.watch(["n1", "n2"], 3)
    try:
        yield server
    finally:
        server.close()


def test_a_malformed_hello_closes_its_connection_only(
    port_with_token: PresenceServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-ASCII ``sig`` once killed rank 0's presence thread (a crash was then found
    by the heartbeats, 6-7 s later): now it costs that connection, with one line."""
    caplog.set_level(logging.DEBUG, logger="elastic.core.tcpstore.limits")
    bad = [
        lambda n: json.dumps({"id": "n1", "round": 3, "nonce": n, "sig": "é" * 64}).encode(),
        lambda n: b'{"id": "n1", "round": 3, "nonce": "' + n.encode() + b'", "sig": 7}',
        lambda n: b"\xff\xfe" + b"[" * 400,
        lambda n: b'{"id": ["n1"], "round": true}',
        lambda n: b"[]",
    ]
    for forge in bad * 2:
        with raw(port_with_token.port) as sock:
            sock.sendall(forge(challenge(sock)) + b"\n")
            assert closed_within(sock, 5)
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "HELLO" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    # The port still serves: a member's crash is seen within the grace.
    member = raw(port_with_token.port)
    member.sendall(hello_line(TOKEN, "job", "n2", 3, challenge(member)))
    time.sleep(0.2)
    member.close()  # no goodbye: its process died
    started = time.monotonic()
    assert wait_until(lambda: port_with_token.gone() == ["n2"], 5)
    assert time.monotonic() - started < 2 * presence.BLIP_GRACE + 0.5


def test_a_connection_that_never_proved_itself_makes_nobody_lost(
    port_with_token: PresenceServer,
) -> None:
    forged = [
        lambda n: hello_line(None, "job", "n1", 3, n),  # no signature
        lambda n: hello_line(b"a-guess", "job", "n1", 3, n),  # another token
        lambda n: hello_line(TOKEN, "other-job", "n1", 3, n),  # another job's
        lambda n: hello_line(TOKEN, "job", "n1", 2, n),  # an older round
        lambda n: hello_line(TOKEN, "job", "n1", 3, "0" * presence.NONCE_LEN),  # not its own
    ]
    for forge in forged:
        with raw(port_with_token.port) as sock:
            sock.sendall(forge(challenge(sock)))
            assert closed_within(sock, 5)
    time.sleep(3 * presence.BLIP_GRACE)
    assert port_with_token.gone() == []


def test_a_recorded_hello_replayed_proves_nothing(port_with_token: PresenceServer) -> None:
    member = raw(port_with_token.port)
    recorded = hello_line(TOKEN, "job", "n1", 3, challenge(member))
    member.sendall(recorded)
    for _ in range(3):  # on new connections: refused, whatever they do next
        with raw(port_with_token.port) as replay:
            challenge(replay)
            replay.sendall(recorded)
            assert closed_within(replay, 5)
    with member:  # the member's own connection stands
        member.settimeout(0.5)
        with pytest.raises(TimeoutError):
            member.recv(1)
    assert port_with_token.gone() == []


# --- a token job of three agents -----------------------------------------------------------


@pytest.fixture
def make(port: int, tmp_path: Path) -> Iterator[Make]:
    """``make()``: a node of a 2..3-node job with the token."""
    token_file = write_token_file(tmp_path / "token", TOKEN)
    with c10d_handlers(port, config={**CONF, "token_file": token_file}, host=HOST) as make_handler:
        yield lambda: make_handler(2, 3)


def record_hellos(handler: C10dRendezvousHandler) -> list[bytes]:
    """Every hello ``handler`` sends, as someone on the network would record them."""
    monitor = handler._monitor
    assert monitor is not None and monitor.liveness.links.hello is not None
    sent: list[bytes] = []
    say = monitor.liveness.links.hello

    def recorded(rnd: int, nonce: str) -> bytes:
        sent.append(say(rnd, nonce))
        return sent[-1]

    monitor.liveness.links.hello = recorded
    return sent


@pytest.mark.timeout(120)
def test_a_replayed_hello_after_a_round_forms_causes_no_regroup(make: Make) -> None:
    """The exact hello a member sent, replayed to rank 0's port right after the next
    round forms (before the member's own connection): it once made rank 0 declare the
    member lost, fence it and restart every worker, three times out of three."""
    handlers = [make() for _ in range(3)]
    # A member connects the instant its round forms: record from before the first one.
    recorders = {id(h): record_hellos(h) for h in handlers}
    infos = rendezvous_all(handlers, timeout=30)
    rank0 = next(h for h, i in zip(handlers, infos, strict=True) if i.rank == 0)
    victim = next(h for h, i in zip(handlers, infos, strict=True) if i.rank == 1)
    sent = recorders[id(victim)]
    for rnd in range(2):  # each round: the member connects, then a new round forms
        assert wait_until(lambda: len(sent) > rnd, 10)  # noqa: B023
        recorded = sent[-1]
        infos = rendezvous_all(handlers, timeout=30)
        assert rank0._presence is not None
        for _ in range(3):
            with raw(rank0._presence.port) as replay:
                replay.sendall(recorded)
                time.sleep(0.05)
        time.sleep(2.5)  # the member's own connection, the grace and two ticks
        assert all(h.lost_nodes() == [] for h in handlers)
        assert all(h.num_nodes_waiting() == 0 for h in handlers)
    # A crash is still found in about a second, not after heartbeat_timeout (30 s).
    assert victim._monitor is not None
    links = victim._monitor.liveness.links
    assert wait_until(lambda: links.client, 10)
    victim._suspend_heartbeats()
    client = links.client
    assert client is not None and client._sock is not None
    started = time.monotonic()
    client._stop.set()
    client._sock.shutdown(socket.SHUT_RDWR)  # the kernel's close of a dead process
    others = [h for h in handlers if h is not victim]
    assert wait_until(lambda: all(victim.node_id in h.lost_nodes() for h in others), 10)
    assert time.monotonic() - started < 2.5
