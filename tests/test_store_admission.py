"""Our TCPStore server with a job token against strangers on the same network: a
connection that has not proved the token gets a small budget and a cap of its own, so
members are always served; a store that closes a connection at the cap or at the
handshake is busy to our client, never gone or torch-served; and the server proves the
token to the client first, so a listener squatting an endpoint gets nothing from us."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
from elastic.core.interfaces.rendezvous import (
    RendezvousAuthError,
    RendezvousConnectionError,
    RendezvousStoreGoneError,
)
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer, admission, client, limits, wire
from elastic.harness.store_sockets import handshaken, raw
from elastic.plugins.rdzv_c10d.succession import Succession

HOST = "127.0.0.1"
TOKEN = b"the-job-token-of-32-bytes-or-so!"


@pytest.fixture
def caught(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="elastic.core.tcpstore.limits")
    return caplog


def warned(caplog: pytest.LogCaptureFixture, limit: str) -> int:
    return sum(
        1 for r in caplog.records if r.levelname == "WARNING" and f"({limit};" in r.getMessage()
    )


def read_until_closed(sock: socket.socket, within: float = 5.0) -> bytes:
    sock.settimeout(within)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer(HOST, 0, token=TOKEN) as srv:
        yield srv


def test_a_stranger_pipelining_pings_is_dropped_at_its_budget(
    server: TCPStoreServer, caught: pytest.LogCaptureFixture
) -> None:
    for _ in range(2):
        with handshaken(server.port) as sock:  # VALIDATE and one PING
            sock.sendall(wire.request(wire.Query.PING, wire.U32.pack(9)) * 40)
            answers = read_until_closed(sock)
        # Closed once past the budget: the rest of the 40 are never answered.
        assert len(answers) < 4 * admission.STRANGER_REQUESTS
    assert warned(caught, "STRANGER_REQUESTS") == 1
    with handshaken(server.port) as sock:  # bytes, however few the requests
        sock.sendall(b"\x0d" + b"\x00" * admission.STRANGER_BYTES)
        read_until_closed(sock)
    assert warned(caught, "STRANGER_BYTES") == 1
    with TCPStoreClient(HOST, server.port, token=TOKEN) as member:
        member.set("k", "v")
        assert member.get("k") == b"v"


def test_strangers_have_a_cap_of_their_own(
    monkeypatch: pytest.MonkeyPatch, caught: pytest.LogCaptureFixture
) -> None:
    """At their cap, a new stranger is closed while the others are within their grace,
    and pushes out the oldest after it: strangers holding every stranger's slot delay a
    member connecting by about the grace, never keep it out; members already in are
    served throughout."""
    monkeypatch.setattr(admission, "MAX_STRANGERS", 4)
    monkeypatch.setattr(admission, "STRANGER_GRACE", 0.5)
    with TCPStoreServer(HOST, 0, token=TOKEN) as srv:
        member = TCPStoreClient(HOST, srv.port, token=TOKEN)
        strangers = [handshaken(srv.port) for _ in range(4)]
        try:
            with raw(srv.port) as late:  # within the others' grace: closed at once
                assert read_until_closed(late) == b""
            newcomer = TCPStoreClient(HOST, srv.port, timeout=5, token=TOKEN)  # tries again
            assert read_until_closed(strangers[0]) == b""  # the oldest, past its grace
            newcomer.set("k", "v")
            assert member.get("k") == b"v"
            newcomer.close()
        finally:
            member.close()
            for sock in strangers:
                sock.close()
    assert warned(caught, "MAX_STRANGERS") == 1


def test_a_refusal_at_the_cap_is_busy_not_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the members' cap the server closes new connections at once: our client tries
    again (it used to read the close as "store gone", final) and gets in once a member
    leaves."""
    monkeypatch.setattr(limits, "MAX_CONNECTIONS", admission.MAX_STRANGERS + 1)
    with TCPStoreServer(HOST, 0, token=TOKEN) as srv:
        first = TCPStoreClient(HOST, srv.port, token=TOKEN)
        got: list[TCPStoreClient | BaseException] = []

        def connect() -> None:
            try:
                got.append(TCPStoreClient(HOST, srv.port, timeout=10, token=TOKEN))
            except BaseException as exc:
                got.append(exc)

        thread = threading.Thread(target=connect)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive() and not got  # refused, and trying again
        first.close()
        thread.join(10)
        assert len(got) == 1 and isinstance(got[0], TCPStoreClient), got
        got[0].set("k", "v")
        got[0].close()


# --- a listener squatting an endpoint -----------------------------------------------------


class Squatter:
    """Listens like a store: answers VALIDATE and PING, then ``on_hello`` decides what
    AUTH_HELLO gets (None: the connection is closed, as torch's server does). Records
    every byte a client sends after its hello."""

    def __init__(self, on_hello: Callable[[], bytes | None]) -> None:
        self.sock = socket.create_server((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.after_hello = b""
        self._on_hello = on_hello
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    first = _recv_exact(conn, 10)  # VALIDATE + PING
                    conn.sendall(first[6:10])  # the nonce back
                    _recv_exact(conn, 1 + 8 + wire.AUTH_CHALLENGE_LEN)  # AUTH_HELLO
                    answer = self._on_hello()
                    if answer is None:
                        continue
                    conn.sendall(answer)
                    while chunk := conn.recv(4096):
                        self.after_hello += chunk
                except OSError:
                    continue

    def close(self) -> None:
        # Closing alone does not wake an accept() blocked in another thread (Linux): the
        # join waited out its 5 s every time. Shutting the listener down does.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def random_proof() -> bytes:
    return wire.blob(b"c" * wire.AUTH_CHALLENGE_LEN) + wire.blob(b"p" * 32)


@pytest.mark.parametrize(
    "answer, error",
    [
        (lambda: None, RendezvousConnectionError),  # closes, as torch's server does
        (lambda: wire.blob(b"") + wire.blob(b""), RendezvousAuthError),  # "no token here"
        (random_proof, RendezvousAuthError),  # a challenge and a proof it cannot make
    ],
)
def test_a_squatter_gets_nothing_and_downgrades_nothing(
    answer: Callable[[], bytes | None], error: type[Exception]
) -> None:
    squatter = Squatter(answer)
    where = f"{HOST}:{squatter.port}"
    try:
        for _ in range(2):
            with pytest.raises(error) as raised:
                TCPStoreClient(HOST, squatter.port, timeout=0.5, token=TOKEN)
            assert not isinstance(raised.value, RendezvousStoreGoneError)
        assert where not in client._TORCH_SERVED  # never taken for torch's, unasked
        assert squatter.after_hello == b""  # not even a proof over its challenge
        # never moved to: the succession's probe finds nothing of the run there
        assert Succession("job", [(HOST, 1)], TOKEN).probe(HOST, squatter.port) is None
    finally:
        squatter.close()


def test_the_server_proves_the_token_first(server: TCPStoreServer) -> None:
    """What an honest client checks before it proves anything: the answer to its
    challenge is the server's proof, over both challenges."""
    with handshaken(server.port) as sock:
        ours = b"x" * wire.AUTH_CHALLENGE_LEN
        sock.sendall(wire.request(wire.Query.AUTH_HELLO, wire.blob(ours)))
        reply = b""
        while len(reply) < 2 * 8 + wire.AUTH_CHALLENGE_LEN + 32:
            reply += sock.recv(4096)
        theirs = reply[8 : 8 + wire.AUTH_CHALLENGE_LEN]
        proof = reply[16 + wire.AUTH_CHALLENGE_LEN :]
        assert proof == wire.auth_proof(TOKEN, wire.SERVER, ours, theirs)
        assert proof != wire.auth_proof(TOKEN, wire.CLIENT, ours, theirs)
