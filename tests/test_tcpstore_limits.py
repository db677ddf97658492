"""The listeners' limits (elastic.core.tcpstore.limits): the TCPStore server's and the
presence port's, against misbehaving clients on real sockets on loopback; each limit
costs only the offending connection and is logged once."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.rendezvous.round import presence, presence_client
from elastic.core.rendezvous.round.presence import PresenceServer, hello_line
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer, limits, wire
from elastic.harness.commands import REPO
from elastic.harness.store_sockets import handshaken, raw

HOST = "127.0.0.1"
LOGGER = "elastic.core.tcpstore.limits"


@pytest.fixture
def caught(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level("DEBUG", logger=LOGGER)
    return caplog


def warnings_about(caplog: pytest.LogCaptureFixture, limit: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelname == "WARNING" and limit in r.getMessage()
    ]


@pytest.fixture
def clients() -> Iterator[list[TCPStoreClient]]:
    made: list[TCPStoreClient] = []
    yield made
    for client in made:
        client.close()


def closed_by_server(sock: socket.socket, within: float = 10.0) -> bytes:
    """What the server sent before it closed ``sock``; fails if it did not close it
    within ``within`` seconds."""
    sock.settimeout(within)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # closed with unread bytes: a reset, dropped all the same
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {within}s")
    return received


def responsive(port: int, clients: list[TCPStoreClient]) -> None:
    client = TCPStoreClient(HOST, port, timeout=10)
    clients.append(client)
    assert client.add("alive", 1) > 0
    client.set("x", b"y")
    assert client.get("x") == b"y"


@pytest.mark.timeout(60)
def test_an_answer_over_the_cap_drops_the_asker_only(
    caught: pytest.LogCaptureFixture, clients: list[TCPStoreClient]
) -> None:
    with TCPStoreServer(HOST, 0) as server:
        writer = TCPStoreClient(HOST, server.port)
        clients.append(writer)
        writer.set("big", b"x" * wire.MAX_VALUE_LEN)  # a legal value
        assert writer.check(["big"])
        # 9 x 8 MiB: over MAX_REPLY_LEN, from a 200-byte request (128Ki names: 1 TiB).
        asks = 1 + limits.MAX_REPLY_LEN // wire.MAX_VALUE_LEN
        greedy = wire.request(wire.Query.MULTI_GET, wire.blobs([b"/big"] * asks))
        for _ in range(2):
            with handshaken(server.port) as sock:
                sock.sendall(greedy)
                assert closed_by_server(sock) == b""
        responsive(server.port, clients)
        # As many as the cap allows is still answered.
        allowed = limits.MAX_REPLY_LEN // (wire.MAX_VALUE_LEN + 8)
        values = writer.multi_get(["big"] * allowed)
        assert len(values) == allowed and all(len(v) == wire.MAX_VALUE_LEN for v in values)
    assert len(warnings_about(caught, "MAX_REPLY_LEN")) == 1


@pytest.mark.timeout(60)
def test_connections_over_the_cap_are_closed_at_once(
    caught: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, clients: list[TCPStoreClient]
) -> None:
    monkeypatch.setattr(limits, "MAX_CONNECTIONS", 4)
    with TCPStoreServer(HOST, 0) as server:
        held = [handshaken(server.port) for _ in range(4)]
        try:
            for _ in range(3):  # the excess is closed, not left waiting in the backlog
                with raw(server.port) as excess:
                    excess.sendall(wire.handshake(9))
                    assert closed_by_server(excess) == b""
            held.pop().close()
            deadline = time.monotonic() + 10
            while server.clients > 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            responsive(server.port, clients)  # a freed place is taken again
        finally:
            for sock in held:
                sock.close()
    assert len(warnings_about(caught, "MAX_CONNECTIONS")) == 1


@pytest.mark.timeout(60)
def test_before_its_handshake_a_connection_may_send_only_a_validate(
    caught: pytest.LogCaptureFixture, clients: list[TCPStoreClient]
) -> None:
    with TCPStoreServer(HOST, 0) as server:
        for _ in range(2):
            with raw(server.port) as stranger:
                # A SET announcing an 8 MiB value (legal once validated): refused on its
                # header, before the server buffers a byte of the value.
                header = wire.request(
                    wire.Query.SET, wire.blob(b"/k"), wire.U64.pack(wire.MAX_VALUE_LEN)
                )
                stranger.sendall(header + b"v" * 1024)
                assert closed_by_server(stranger, within=5) == b""
        responsive(server.port, clients)
    assert len(warnings_about(caught, "MAX_REQUEST_LEN")) == 1


def test_until_the_token_is_proved_a_connection_may_send_only_the_handshake(
    caught: pytest.LogCaptureFixture,
) -> None:
    with TCPStoreServer(HOST, 0, token=b"job-token") as server, handshaken(server.port) as sock:
        # Validated but not authenticated: a SET announcing an 8 MiB value is refused on
        # its header, not buffered until its end (or the request deadline) before refusal.
        header = wire.request(wire.Query.SET, wire.blob(b"/k"), wire.U64.pack(wire.MAX_VALUE_LEN))
        sock.sendall(header)
        assert closed_by_server(sock, within=5) == b""
    assert len(warnings_about(caught, "MAX_REQUEST_LEN")) == 1


@pytest.mark.timeout(60)
def test_a_validated_request_over_the_cap_is_dropped(caught: pytest.LogCaptureFixture) -> None:
    with TCPStoreServer(HOST, 0) as server, handshaken(server.port) as sock:
        # A MULTI_SET of 9 legal 8 MiB values: 72 MiB, over MAX_REQUEST_LEN.
        count = 1 + wire.MAX_REQUEST_LEN // wire.MAX_VALUE_LEN
        sock.sendall(wire.request(wire.Query.MULTI_SET, wire.I64.pack(count)))
        value = wire.blob(b"v" * wire.MAX_VALUE_LEN)
        try:
            for i in range(count):
                sock.sendall(wire.blob(b"/k%d" % i) + value)
        except (BrokenPipeError, ConnectionResetError):
            pass  # dropped while we were still sending: what is expected
        closed_by_server(sock)
    assert len(warnings_about(caught, "MAX_REQUEST_LEN")) == 1


@pytest.mark.timeout(60)
def test_stalled_handshakes_and_requests_are_dropped_idle_connections_are_not(
    caught: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, clients: list[TCPStoreClient]
) -> None:
    monkeypatch.setattr(limits, "HANDSHAKE_WAIT", 1.0)
    monkeypatch.setattr(limits, "REQUEST_WAIT", 1.0)
    with TCPStoreServer(HOST, 0) as server:
        idle = TCPStoreClient(HOST, server.port)
        waiter = TCPStoreClient(HOST, server.port, timeout=30)
        clients += [idle, waiter]
        woken: list[BaseException | None] = []

        def wait() -> None:
            try:
                waiter.wait(["late"], timedelta(seconds=30))
                woken.append(None)
            except (StoreTimeoutError, Exception) as exc:
                woken.append(exc)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        silent = raw(server.port)  # connects and says nothing
        half_hello = raw(server.port)
        half_hello.sendall(wire.handshake(3)[:3])
        half_request = handshaken(server.port)
        half_request.sendall(wire.request(wire.Query.SET, wire.blob(b"/half"))[:-2])
        # A slow but steady client: each request completes, so none of them is stalled.
        steady = handshaken(server.port)
        ping = wire.request(wire.Query.PING, wire.U32.pack(5))
        started = time.monotonic()
        while time.monotonic() - started < 2.5:
            steady.sendall(ping[:2])
            time.sleep(0.3)
            steady.sendall(ping[2:])
            assert steady.recv(4) == wire.U32.pack(5)
        for sock in (silent, half_hello, half_request):
            with sock:
                assert closed_by_server(sock, within=5) == b""
        # Idle between requests and parked in a WAIT for longer than both limits: kept.
        assert idle.add("n", 1) == 1
        assert not woken
        idle.set("late", b"1")
        thread.join(10)
        assert woken == [None]
        steady.close()
    assert len(warnings_about(caught, "HANDSHAKE_WAIT")) == 1
    assert len(warnings_about(caught, "REQUEST_WAIT")) == 1


@pytest.mark.timeout(60)
def test_a_client_that_stops_reading_its_answers_is_dropped_in_time(
    caught: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, clients: list[TCPStoreClient]
) -> None:
    monkeypatch.setattr(limits, "REQUEST_WAIT", 1.0)
    with TCPStoreServer(HOST, 0) as server:
        writer = TCPStoreClient(HOST, server.port)
        clients.append(writer)
        writer.set("big", b"x" * (1 << 20))
        assert writer.check(["big"])
        with handshaken(server.port) as hoarder:
            # 64 answers of 1 MiB, never read: paused at the high-water mark, and once
            # nothing moves for REQUEST_WAIT, dropped (its buffers freed).
            hoarder.sendall(wire.request(wire.Query.GET, wire.blob(b"/big")) * 64)
            deadline = time.monotonic() + 10
            while server.clients > 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.clients == 1  # the writer only
        responsive(server.port, clients)
    assert len(warnings_about(caught, "REQUEST_WAIT")) == 1


EMFILE_CHILD = textwrap.dedent(
    """
    import logging, os, resource, sys, time
    from elastic.core.rendezvous.round.presence import PresenceServer
    from elastic.core.tcpstore import TCPStoreServer
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    if sys.argv[1] == "tcpstore":
        server = TCPStoreServer("127.0.0.1", 0)
    else:
        server = PresenceServer("127.0.0.1", None, "job")
    hog = []
    try:
        while True:  # every descriptor the server could accept into
            hog.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print(server.port, flush=True)
    sys.stdin.readline()  # a client is waiting in the backlog now
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(2.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"{cpu:.3f}", flush=True)
    for fd in hog:
        os.close(fd)
    deadline = time.monotonic() + 10
    while not server._conns and time.monotonic() < deadline:
        time.sleep(0.05)
    print("accepted" if server._conns else "not accepted", flush=True)
    sys.stdin.readline()  # the client was served
    server.close()
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["tcpstore", "presence"])
def test_out_of_descriptors_accept_backs_off_instead_of_spinning(kind: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", EMFILE_CHILD, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        port = int(child.stdout.readline())
        with raw(port) as waiting:
            waiting.sendall(wire.handshake(11))
            time.sleep(0.2)  # it is in the backlog; accept fails with EMFILE
            child.stdin.write("go\n")
            child.stdin.flush()
            cpu = float(child.stdout.readline())
            # Descriptors are back: the waiting client is accepted (and answered).
            assert child.stdout.readline().strip() == "accepted"
            if kind == "tcpstore":
                waiting.settimeout(10)
                assert waiting.recv(4) == wire.U32.pack(11)
        child.stdin.write("done\n")
        child.stdin.flush()
        _, err = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    # A loop that retried at once would burn the 2 s (a core); backing off costs ~nothing.
    assert cpu < 0.3, f"the server used {cpu}s of CPU in 2s while out of descriptors"
    assert err.count("cannot accept") == 1, err


# --- the presence port, by the same rules ---------------------------------------------------

CHALLENGE = re.compile(rb"[0-9a-f]{%d}\n" % presence.NONCE_LEN)


def hello_of(node: str, rnd: int = 0) -> Callable[[str], bytes]:
    """A member's answer to a challenge (tokenless job "job")."""
    return lambda nonce: hello_line(None, "job", node, rnd, nonce)


def say_hello(sock: socket.socket, node: str, rnd: int = 0) -> None:
    """Read the presence port's challenge on ``sock`` and answer it as ``node``."""
    line = b""
    while not line.endswith(b"\n"):
        line += sock.recv(64)
    sock.sendall(hello_of(node, rnd)(line.strip().decode()))


@pytest.fixture
def presence_port() -> Iterator[PresenceServer]:
    server = PresenceServer(HOST, None, "job")
    server.watch(["n1", "n2"], 0)
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_presence_connections_over_the_cap_are_closed_at_once(
    caught: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(presence, "MAX_CONNECTIONS", 2)
    server = PresenceServer(HOST, None, "job")
    server.watch(["n1", "n2"], 0)
    held = [raw(server.port) for _ in range(2)]
    try:
        for sock, node in zip(held, ["n1", "n2"], strict=True):
            say_hello(sock, node)
        for _ in range(3):
            with raw(server.port) as excess:
                assert closed_by_server(excess) == b""  # not even a challenge
        for sock in held:  # the two within the cap are kept
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):
                sock.recv(1)
    finally:
        for sock in held:
            sock.close()
        server.close()
    assert len(warnings_about(caught, "MAX_CONNECTIONS")) == 1


@pytest.mark.timeout(60)
def test_presence_hellos_that_are_late_or_too_long_are_dropped(
    caught: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, presence_port: PresenceServer
) -> None:
    monkeypatch.setattr(presence, "HELLO_WAIT", 0.5)
    member = raw(presence_port.port)
    say_hello(member, "n1")
    for _ in range(2):
        with raw(presence_port.port) as silent, raw(presence_port.port) as chatty:
            chatty.sendall(b"x" * (2 * presence.HELLO_MAX))
            assert CHALLENGE.fullmatch(closed_by_server(chatty, within=5))
            assert CHALLENGE.fullmatch(closed_by_server(silent, within=5))
    with member:  # a member that said hello stays, however long it says nothing more
        member.settimeout(0.5)
        with pytest.raises(TimeoutError):
            member.recv(1)
    assert len(warnings_about(caught, "HELLO_WAIT")) == 1
    assert len(warnings_about(caught, "HELLO_MAX")) == 1


@pytest.mark.timeout(60)
def test_a_rounds_connects_at_once_are_each_challenged_and_the_silent_dropped_on_time(
    monkeypatch: pytest.MonkeyPatch, presence_port: PresenceServer
) -> None:
    """A round's members connect at once: every connection queued is challenged, those
    that answer stay, and each silent one is dropped when its own ``HELLO_WAIT`` is up,
    neither sooner nor held back by those that came before or after it."""
    monkeypatch.setattr(presence, "HELLO_WAIT", 1.5)
    burst = [raw(presence_port.port) for _ in range(300)]  # queued before any is read
    late = None
    try:
        for i, sock in enumerate(burst):
            if i % 3:
                say_hello(sock, f"n{i}")
        time.sleep(0.8)
        late = raw(presence_port.port)  # due 0.8 s after the burst's silent ones
        silent = [sock for i, sock in enumerate(burst) if not i % 3]
        started = time.monotonic()
        for sock in silent:
            assert CHALLENGE.fullmatch(closed_by_server(sock, within=5))
        assert time.monotonic() - started < 1.4  # their own wait, not the late one's
        late.settimeout(5)
        line = b""
        while not line.endswith(b"\n"):
            line += late.recv(64)
        assert CHALLENGE.fullmatch(line)
        late.settimeout(0.3)
        with pytest.raises(TimeoutError):  # open still: its own wait is not up
            late.recv(1)
        assert closed_by_server(late, within=5) == b""
        for i, sock in enumerate(burst):
            if i % 3:  # a member that said hello stays
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
    finally:
        for sock in [*burst, *([late] if late else [])]:
            sock.close()


@pytest.mark.timeout(30)
def test_a_member_stopped_while_it_connects_says_goodbye(presence_port: PresenceServer) -> None:
    """A presence connection stopped after it answered the challenge but before the
    client kept it (a new round came at once) leaves with a goodbye: rank 0 never takes
    it for a death (it did, for 1 in 7 members of a 1024-node round)."""
    clients: list[presence_client.PresenceClient] = []
    made = threading.Event()
    answer = hello_of("n1")

    def stopped_as_it_answers(nonce: str) -> bytes:
        made.wait(5)
        clients[0].stop()  # on the presence thread, between the challenge and our hello
        return answer(nonce)

    clients.append(
        presence_client.PresenceClient(
            HOST, presence_port.port, stopped_as_it_answers, lambda: None
        )
    )
    made.set()
    assert clients[0].ended.wait(5)
    time.sleep(4 * presence.BLIP_GRACE)
    assert "n1" not in presence_port.silent()[0]  # it said hello: proven
    assert presence_port.gone() == []


@pytest.mark.timeout(30)
def test_a_rank_0_too_busy_to_accept_is_not_taken_for_dead() -> None:
    """A member's presence connection closes and rank 0's port, still there, does not
    accept a new one in time (its accept queue is full: a rank 0 starved of CPU): only a
    refusal says its process is gone, so the member reports nothing and leaves rank 0 to
    the heartbeats. When nothing listens any more (refused), it does report it."""
    for busy in (True, False):
        gone = threading.Event()
        listener = socket.create_server((HOST, 0), backlog=0)
        port = listener.getsockname()[1]
        client = presence_client.PresenceClient(HOST, port, hello_of("n1"), gone.set)
        member, _ = listener.accept()
        member.sendall(b"0" * presence.NONCE_LEN + b"\n")  # a challenge
        # Busy: a connection nobody accepts fills the accept queue (of 1), so the next
        # connect's SYNs are dropped and it times out. Gone: the port is closed.
        filler = socket.create_connection((HOST, port)) if busy else None
        if not busy:
            listener.close()
        try:
            member.close()  # unasked: no goodbye
            assert client.ended.wait(presence.HELLO_WAIT + 3)
            assert gone.is_set() is not busy
        finally:
            if filler is not None:
                filler.close()
            listener.close()
