"""torch's TCPStore client gets from our server what it gets from torch's own, for every
request it can send (``tcpstore_differential``); the requests added for that keep the
server's limits."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import pytest
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer, limits, wire
from elastic.harness.store_sockets import handshaken
from tcpstore_differential import differences, served

HOST = "127.0.0.1"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_torch_client_sees_the_same_from_our_server_as_from_torchs() -> None:
    pytest.importorskip("torch")
    with served("torch") as port_torch, served("ours") as port_ours:
        theirs, differ = differences(port_torch, port_ours)
    assert not differ, "\n".join(differ)
    # The scenario exercised what it says, on torch's server too (not errors everywhere).
    seen = dict(theirs)
    assert seen["append to a key"] is None and seen["get"] == (b"v+w", b"x")
    assert seen["queue_pop"] == b"v1" and seen["queue_pop without blocking"] == b"v2"
    assert seen["queue_pop of an empty queue"] == ("raised", "QueueEmptyError")
    assert seen["one push, two blocked pops"] == [[b"one"], []]
    assert seen["barrier count"] == b"2"
    assert seen["list_keys at the end"][:2] == ["ap", "b1"]


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer(HOST, 0) as srv:
        yield srv


def dropped(sock: socket.socket, within: float = 10.0) -> bool:
    """Whether the server closes ``sock`` (reading nothing) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("query", [wire.Query.APPEND, wire.Query.QUEUE_PUSH])
def test_a_value_over_the_cap_is_refused_on_its_header(
    server: TCPStoreServer, query: wire.Query
) -> None:
    with handshaken(server.port) as sock:
        header = wire.request(query, wire.blob(b"/k"), wire.U64.pack(wire.MAX_VALUE_LEN + 1))
        sock.sendall(header)  # not a byte of the value: refused on the length alone
        assert dropped(sock)
    with handshaken(server.port) as sock:
        sock.sendall(wire.request(query, wire.blob(b"/k"), wire.blob(b"fits")))
        sock.sendall(wire.request(wire.Query.QUEUE_LEN, wire.blob(b"/k")))
        expected = 1 if query is wire.Query.QUEUE_PUSH else 0
        assert sock.recv(8) == wire.I64.pack(expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("query", [wire.Query.QUEUE_POP, wire.Query.QUEUE_LEN, wire.Query.BARRIER])
def test_a_key_over_the_cap_is_refused(server: TCPStoreServer, query: wire.Query) -> None:
    with handshaken(server.port) as sock:
        sock.sendall(wire.request(query, wire.U64.pack(wire.MAX_KEY_LEN + 1)))
        assert dropped(sock)


@pytest.mark.timeout(60)
def test_a_key_list_over_the_answer_cap_drops_the_asker_only(
    server: TCPStoreServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="elastic.core.tcpstore")
    writer = TCPStoreClient(HOST, server.port)
    try:
        writer.multi_set([f"key{i:04d}" for i in range(100)], [b""] * 100)
        # 100 keys of 8 bytes take 1,600 bytes to list: over a 1,000-byte cap, under 2,000.
        monkeypatch.setattr(limits, "MAX_REPLY_LEN", 1000)
        with handshaken(server.port) as sock:
            sock.sendall(wire.request(wire.Query.LIST_KEYS))
            assert dropped(sock)
        monkeypatch.setattr(limits, "MAX_REPLY_LEN", 2000)
        with handshaken(server.port) as sock:
            sock.sendall(wire.request(wire.Query.LIST_KEYS))
            expected = 8 + 100 * (8 + len("/key0000"))
            received = b""
            deadline = time.monotonic() + 10
            while len(received) < expected and time.monotonic() < deadline:
                received += sock.recv(expected - len(received))
            assert wire.I64.unpack(received[:8]) == (100,) and len(received) == expected
        assert writer.get("key0099") == b""
    finally:
        writer.close()
    assert any("MAX_REPLY_LEN" in r.getMessage() for r in caplog.records)
