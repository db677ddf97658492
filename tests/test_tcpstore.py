"""The torch-free TCPStore client and server (elastic.core.tcpstore): real sockets on
loopback, and torch's own TCPStore on the other end for interoperability."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from elastic.core.interfaces.rendezvous import RendezvousConnectionError, RendezvousStoreGoneError
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer, wire
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.harness.commands import REPO
from elastic.harness.store_sockets import handshaken, raw
from elastic.testing.ports import free_port

HOST = "127.0.0.1"
ClientFactory = Callable[..., TCPStoreClient]


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    srv = TCPStoreServer(HOST, 0)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def connect() -> Iterator[ClientFactory]:
    """Clients that are closed at teardown whatever the test did."""
    clients: list[TCPStoreClient] = []

    def make(port: int, timeout: float = 10.0, **kwargs: object) -> TCPStoreClient:
        client = TCPStoreClient(HOST, port, timeout=timeout, **kwargs)  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def torch_server(use_libuv: bool) -> Any:
    """torch's own TCPStore server, listening on loopback only (its master would bind
    every interface; an already bound socket keeps it to this one)."""
    from torch.distributed import TCPStore

    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen()
    port = sock.getsockname()[1]
    return TCPStore(
        HOST,
        port,
        None,
        True,
        timedelta(seconds=10),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        use_libuv=use_libuv,
    )


def torch_client(port: int, timeout: float = 10.0) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(HOST, port, None, False, timedelta(seconds=timeout))


@pytest.fixture(params=["ours", "torch-libuv", "torch-legacy"])
def any_server(request: pytest.FixtureRequest) -> Iterator[int]:
    """The port of a running server of each kind."""
    if request.param == "ours":
        srv = TCPStoreServer(HOST, 0)
        try:
            yield srv.port
        finally:
            srv.close()
    else:
        store = torch_server(use_libuv=request.param == "torch-libuv")
        yield store.port
        del store  # the last reference: torch stops its server here


@contextmanager
def after(seconds: float, action: Callable[[], object]) -> Iterator[None]:
    """Run ``action`` in a thread ``seconds`` from now; on exit, join it and raise what
    it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        time.sleep(seconds)
        try:
            action()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(30)
    if errors:
        raise errors[0]


# --- our client, against every server ------------------------------------------------------


@pytest.mark.timeout(60)
def test_every_operation(any_server: int, connect: ClientFactory) -> None:
    c = connect(any_server)
    other = connect(any_server)

    c.set("a", b"1")
    c.set("s", "text")
    assert c.get("a") == b"1" and other.get("s") == b"text"

    assert c.add("n", 5) == 5
    assert other.add("n", -2) == 3
    assert c.get("n") == b"3"

    assert c.compare_set("cs", "", "v1") == b"v1"  # absent, expected "": set
    assert c.compare_set("cs", "wrong", "v2") == b"v1"  # mismatch: current value
    assert c.compare_set("cs", "v1", "v2") == b"v2"  # match: new value
    assert c.compare_set("absent", "e", "d") == b"e"  # absent, expected set: torch's lie
    assert not c.check(["absent"])

    assert c.check(["a", "n"]) and not c.check(["a", "nope"]) and c.check([])
    assert c.delete_key("a") is True and c.delete_key("a") is False
    assert not c.check(["a"])

    c.multi_set(["m1", "m2"], [b"x", "y"])
    assert other.multi_get(["m1", "m2", "n"]) == [b"x", b"y", b"3"]
    assert c.multi_get([]) == []
    assert c.num_keys() == 5  # s, n, cs, m1, m2

    c.wait(["m1", "s"])  # present: returns at once
    with after(0.3, lambda: other.set("late", b"L")):
        c.wait(["late"], timedelta(seconds=20))
    with after(0.3, lambda: other.set("later", b"LL")):
        assert c.get("later") == b"LL"  # get blocks until the key exists

    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=f"{HOST}:{any_server}"):
        c.wait(["never"], timedelta(seconds=0.5))
    assert 0.4 < time.monotonic() - started < 5
    assert c.get("s") == b"text"  # the cancelled wait left the stream in step


@pytest.mark.timeout(60)
def test_wait_get_brings_what_it_waited_for(any_server: int, connect: ClientFactory) -> None:
    c, other = connect(any_server), connect(any_server)
    # Only a server of ours takes WAIT_GET; torch's get a WAIT and a MULTI_GET.
    assert c.probe_wait_get() is c.ours
    c.set("a", b"1")
    assert c.wait_get(["a"]) == [b"1"]
    with after(0.3, lambda: other.set("late", b"L")):
        assert c.wait_get(["late", "a"], timedelta(seconds=20)) == [b"L", b"1"]
    with pytest.raises(StoreTimeoutError, match="never"):
        c.wait_get(["never", "a"], timedelta(seconds=0.3))
    assert c.get("a") == b"1"  # the cancelled wait left the stream in step


@pytest.mark.timeout(60)
def test_a_confirmed_set_is_one_round_trip(any_server: int, connect: ClientFactory) -> None:
    # The SET and the request whose answer proves it applied go in one send: the server
    # reads both at once and answers once.
    c = connect(any_server)
    sent: list[bytes] = []
    original = c._sock
    c._sock = _Recording(original, sent)
    c.set("k", b"v", confirmed=True)
    c.multi_set(["m1", "m2"], [b"1", b"2"], confirmed=True)
    c._sock = original
    assert [s[0] for s in sent] == [wire.Query.SET, wire.Query.MULTI_SET]
    assert all(s.endswith(wire.request(wire.Query.GETNUMKEYS)) for s in sent)
    assert c.multi_get(["k", "m1", "m2"]) == [b"v", b"1", b"2"]


class _Recording:
    """A socket whose sends are recorded."""

    def __init__(self, sock: socket.socket, sent: list[bytes]) -> None:
        self._sock, self._sent = sock, sent

    def sendall(self, data: bytes) -> None:
        self._sent.append(bytes(data))
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _answer(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


@pytest.mark.timeout(60)
def test_wait_get_on_the_wire(
    server: TCPStoreServer, connect: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic.core.tcpstore import limits

    writer = connect(server.port)
    sock = handshaken(server.port)
    try:
        wait_get = wire.request(wire.Query.WAIT_GET, wire.blobs([b"/k"]))
        sock.sendall(wait_get)
        writer.set("k", b"value")
        stop = wire.U8.pack(wire.STOP_WAITING)
        assert _answer(sock, 2 + 8 + 5) == stop + wire.U8.pack(wire.VALUES) + wire.blob(b"value")
        # A CANCEL_WAIT that crosses the answer is answered after it and its values.
        sock.sendall(wire.request(wire.Query.WAIT_GET, wire.blobs([b"/k2", b"/k"])))
        writer.set("k2", b"v2")
        writer.num_keys()  # the SET is applied: the answer is on its way
        sock.sendall(wire.request(wire.Query.CANCEL_WAIT))
        values = wire.U8.pack(wire.VALUES) + wire.blob(b"v2") + wire.blob(b"value")
        cancelled = wire.U8.pack(wire.WAIT_CANCELED)
        assert _answer(sock, 2 + 2 * 8 + 7 + 1) == stop + values + cancelled
        # Values past the reply limit are not sent: the client reads them as it always
        # would (a MULTI_GET, which the limit governs).
        monkeypatch.setattr(limits, "MAX_REPLY_LEN", 8 + 4)
        sock.sendall(wait_get)
        assert _answer(sock, 2) == stop + wire.U8.pack(wire.NO_VALUES)
        sock.sendall(wire.request(wire.Query.GETNUMKEYS))
        assert _answer(sock, 8) == wire.I64.pack(2)  # in step
    finally:
        sock.close()


@pytest.mark.timeout(60)
def test_an_older_server_of_ours_is_waited_on_as_before(
    server: TCPStoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server from before WAIT_GET (a node let in with allow_mismatch=elastic) closes a
    # connection that sends it: the waiting connection is made again, and waits as before.
    monkeypatch.delitem(wire._LAYOUT, wire.Query.WAIT_GET.value)
    conn = Connection(HOST, server.port, timeout=10.0)
    store = PrefixStore(conn, "job/")
    try:
        store.set("a", b"1")
        with after(0.3, lambda: store.set("late", b"L")):
            assert store.wait_get(["late", "a"], timedelta(seconds=20)) == [b"L", b"1"]
        assert store.wait_get(["a"]) == [b"1"]
        assert conn._older_server
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_get_and_multi_get_time_out_like_wait(server: TCPStoreServer, connect: ClientFactory):
    c = connect(server.port, timeout=0.5)
    c.set("here", b"1")
    with pytest.raises(StoreTimeoutError, match="never"):
        c.get("never")
    with pytest.raises(StoreTimeoutError):
        c.multi_get(["here", "never"])
    assert c.multi_get(["here"]) == [b"1"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "wake",
    [
        lambda s: s.set("k", b"v"),
        lambda s: s.add("k", 1),
        lambda s: s.compare_set("k", "", "v"),
        lambda s: s.multi_set(["other", "k"], [b"1", b"2"]),
    ],
    ids=["set", "add", "compare_set", "multi_set"],
)
def test_parked_wait_is_woken_by(
    wake: Callable[[TCPStoreClient], object], server: TCPStoreServer, connect: ClientFactory
) -> None:
    waiter, writer = connect(server.port), connect(server.port)
    started = time.monotonic()
    with after(0.3, lambda: wake(writer)):
        waiter.wait(["k"], timedelta(seconds=30))
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_a_waiter_that_cannot_be_sent_to_costs_the_writer_nothing(
    server: TCPStoreServer, connect: ClientFactory
) -> None:
    # The server sends a woken waiter's answer from within the writer's request: a send
    # that fails there drops the waiter (by the loop), never the writer.
    writer = connect(server.port)
    broken, live = handshaken(server.port), handshaken(server.port)
    for sock in (broken, live):
        sock.sendall(wire.request(wire.Query.WAIT, wire.blobs([b"/k"])))
    writer.num_keys()  # both WAITs are parked by now (sent before, on loopback)
    where = broken.getsockname()
    (served,) = [s for s in list(server._conns) if s.getpeername() == where]
    served.shutdown(socket.SHUT_WR)  # the server's sends to it fail (EPIPE)
    writer.set("k", b"v")
    assert writer.get("k") == b"v" and writer.add("n", 1) == 1
    assert live.recv(1) == wire.U8.pack(wire.STOP_WAITING)
    deadline = time.monotonic() + 5
    while server.clients > 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.clients == 2  # the writer and the live waiter
    for sock in (broken, live):
        sock.close()


@pytest.mark.timeout(60)
def test_wait_on_several_keys_needs_all_of_them(server: TCPStoreServer, connect: ClientFactory):
    waiter, writer = connect(server.port), connect(server.port)
    done = threading.Event()

    def wait() -> None:
        waiter.wait(["a", "b"], timedelta(seconds=30))
        done.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    writer.set("a", b"1")
    assert not done.wait(0.5)
    writer.set("b", b"1")
    assert done.wait(10)
    thread.join(10)


@pytest.mark.timeout(60)
def test_clients_heard_within_counts_the_talking_and_the_parked(
    server: TCPStoreServer, connect: ClientFactory
) -> None:
    silent, talker, waiter = (connect(server.port) for _ in range(3))
    thread = threading.Thread(
        target=lambda: waiter.wait(["never"], timedelta(seconds=20)), daemon=True
    )
    thread.start()
    time.sleep(0.5)
    talker.add("k", 1)  # a SET has no answer: an ADD is surely served once it returns
    assert server.clients == 3
    assert server.clients_heard_within(0.3) == 2  # the talker and the parked waiter
    silent.add("k", 1)
    assert server.clients_heard_within(0.3) == 3
    time.sleep(0.5)
    assert server.clients_heard_within(0.3) == 1  # only the parked waiter
    talker.set("never", b"1")
    thread.join(10)


@pytest.mark.timeout(120)
def test_concurrent_clients_add_atomically(server: TCPStoreServer, connect: ClientFactory):
    shared = connect(server.port)  # one client used from every thread: the lock
    threads, per_thread = 8, 200
    own = [connect(server.port) for _ in range(threads)]
    errors: list[BaseException] = []

    def work(client: TCPStoreClient) -> None:
        try:
            for _ in range(per_thread):
                client.add("counter", 1)
                shared.add("counter", 1)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(c,)) for c in own]
    for t in workers:
        t.start()
    for t in workers:
        t.join(100)
    assert not errors
    assert shared.add("counter", 0) == 2 * threads * per_thread


# --- torch's client against our server ----------------------------------------------------


@pytest.mark.timeout(60)
def test_view_reads_missing_keys_as_empty_without_blocking(any_server: int) -> None:
    # The rendezvous reads heartbeats and counters that may not exist yet in one
    # MULTI_GET; torch's legacy server drops the connection on a missing key, so the
    # view CHECKs a key once before it reads it that way. No read may wait for the
    # client's 10 s timeout.
    conn = Connection(HOST, any_server, timeout=10.0)
    store = PrefixStore(conn, "job/")
    try:
        store.set("a", b"1")
        started = time.monotonic()
        assert store.multi_get(["a", "missing", "a"]) == [b"1", b"", b"1"]
        assert store.multi_get(["missing"]) == [b""]
        store.set("missing", b"now")
        store.set("a", b"2")
        assert store.multi_get(["missing", "a"]) == [b"now", b"2"]
        assert store.delete_key("a")
        assert store.multi_get(["a", "missing"]) == [b"", b"now"]
        assert store.multi_get([]) == []
        assert time.monotonic() - started < 5
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_a_parked_wait_holds_no_other_call_of_its_view(server: TCPStoreServer) -> None:
    # A node waiting for its round's outcome must still be able to close the round,
    # read progress and shut down: the wait has a connection of its own.
    conn = Connection(HOST, server.port, timeout=10.0)
    store = PrefixStore(conn, "job/")
    outcome: list[BaseException | None] = []

    def wait_for(key: str) -> None:
        try:
            store.wait([key], timedelta(seconds=30))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        waiter = threading.Thread(target=wait_for, args=("late",), daemon=True)
        waiter.start()
        time.sleep(0.3)  # parked on the server
        started = time.monotonic()
        store.set("other", b"1")
        assert store.get("other") == b"1" and store.add("n", 2) == 2
        assert time.monotonic() - started < 2
        store.set("late", b"here")
        waiter.join(5)
        assert outcome == [None]
        # A second wait reuses the parked one's connection; an abandoned wait does not
        # stop the next, and closing the view wakes it at once.
        store.wait(["late"], timedelta(seconds=5))
        outcome.clear()
        waiter = threading.Thread(target=wait_for, args=("never",), daemon=True)
        waiter.start()
        time.sleep(0.3)
        store.wait(["late"], timedelta(seconds=5))
        started = time.monotonic()
        conn.close()
        waiter.join(5)
        assert not waiter.is_alive() and time.monotonic() - started < 2
        assert len(outcome) == 1 and isinstance(outcome[0], RendezvousConnectionError)
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_torch_client_against_our_server(server: TCPStoreServer, connect: ClientFactory):
    from torch.distributed import DistStoreError

    t = torch_client(server.port)
    ours = connect(server.port)
    t.set("a", "1")
    assert ours.get("a") == b"1" and t.get("a") == b"1"
    assert t.add("n", 3) == 3 and ours.add("n", 2) == 5
    assert t.compare_set("cs", "", "v") == b"v"
    assert t.compare_set("cs", "x", "y") == b"v"
    assert t.compare_set("cs", "v", "w") == b"w"
    assert t.compare_set("absent", "e", "d") == b"e"
    assert t.check(["a", "n"]) and not t.check(["a", "zz"])
    assert t.delete_key("a") and not t.delete_key("a")
    ours.multi_set(["m1", "m2"], ["x", "y"])
    assert t.multi_get(["m1", "m2"]) == [b"x", b"y"]
    assert t.num_keys() == ours.num_keys() == 4

    with after(0.3, lambda: ours.set("late", "L")):
        t.wait(["late"], timedelta(seconds=20))
    with after(0.3, lambda: ours.set("later", "LL")):
        assert t.get("later") == b"LL"

    with pytest.raises(DistStoreError, match="timeout"):
        t.wait(["never"], timedelta(seconds=0.5))
    assert t.get("m1") == b"x"  # torch's CANCEL_WAIT was answered: still in step


# --- the wire ------------------------------------------------------------------------------


def one_of_each() -> tuple[bytes, list[wire.Request]]:
    """Every request we serve, encoded, and what parsing it must give."""
    q, blob, blobs = wire.Query, wire.blob, wire.blobs
    keys = (b"/a", b"/b")
    stream = [
        wire.handshake(7),
        wire.request(q.SET, blob(b"/k"), blob(b"value")),
        wire.request(q.COMPARE_SET, blob(b"/k"), blob(b""), blob(b"new")),
        wire.request(q.GET, blob(b"/k")),
        wire.request(q.ADD, blob(b"/n"), wire.I64.pack(-3)),
        wire.request(q.CHECK, blobs(keys)),
        wire.request(q.WAIT, blobs(keys)),
        wire.request(q.GETNUMKEYS),
        wire.request(q.DELETE_KEY, blob(b"/k")),
        wire.request(q.MULTI_GET, blobs(keys)),
        wire.multi_set([(b"/a", b"1"), (b"/b", b"")]),
        wire.request(q.CANCEL_WAIT),
        wire.request(q.APPEND, blob(b"/k"), blob(b"more")),
        wire.request(q.QUEUE_PUSH, blob(b"/q"), blob(b"item")),
        wire.request(q.QUEUE_POP, blob(b"/q")),
        wire.request(q.QUEUE_LEN, blob(b"/q")),
        wire.request(q.LIST_KEYS),
        wire.request(q.BARRIER, blob(b"/b"), wire.I64.pack(4)),
    ]
    R = wire.Request
    parsed = [
        R(q.VALIDATE, number=wire.VALIDATION_MAGIC),
        R(q.PING, number=7),
        R(q.SET, key=b"/k", value=b"value"),
        R(q.COMPARE_SET, key=b"/k", value=b"", desired=b"new"),
        R(q.GET, key=b"/k"),
        R(q.ADD, key=b"/n", number=-3),
        R(q.CHECK, keys=keys),
        R(q.WAIT, keys=keys),
        R(q.GETNUMKEYS),
        R(q.DELETE_KEY, key=b"/k"),
        R(q.MULTI_GET, keys=keys),
        R(q.MULTI_SET, pairs=((b"/a", b"1"), (b"/b", b""))),
        R(q.CANCEL_WAIT),
        R(q.APPEND, key=b"/k", value=b"more"),
        R(q.QUEUE_PUSH, key=b"/q", value=b"item"),
        R(q.QUEUE_POP, key=b"/q"),
        R(q.QUEUE_LEN, key=b"/q"),
        R(q.LIST_KEYS),
        R(q.BARRIER, key=b"/b", number=4),
    ]
    return b"".join(stream), parsed


def parse_in_pieces(stream: bytes, piece: int) -> list[wire.Request]:
    parser, parsed = wire.RequestParser(), []
    for start in range(0, len(stream), piece):
        parser.feed(stream[start : start + piece])
        while (request := parser.next()) is not None:
            parsed.append(request)
    assert parser.buffered == 0
    return parsed


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, 1 << 20])
def test_requests_parse_however_the_stream_is_cut(piece: int) -> None:
    stream, expected = one_of_each()
    assert parse_in_pieces(stream, piece) == expected


@pytest.mark.timeout(120)
def test_a_request_in_many_pieces_is_parsed_once() -> None:
    # 128Ki pairs in 800 pieces: parsing from the start on every piece would take
    # minutes, parsing where it stopped a fraction of a second.
    pairs = tuple((b"/k%06d" % i, b"v") for i in range(wire.MAX_KEY_COUNT))
    started = time.process_time()
    (request,) = parse_in_pieces(wire.multi_set(pairs), 4096)
    assert request.pairs == pairs
    assert time.process_time() - started < 10


# --- misbehaving peers ----------------------------------------------------------------------


def responsive(client: TCPStoreClient, within: float = 3.0) -> None:
    started = time.monotonic()
    assert client.add("alive", 1) > 0
    client.set("x", b"y")
    assert client.get("x") == b"y"
    assert time.monotonic() - started < within


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not even a VALIDATE
        wire.request(wire.Query.VALIDATE, wire.U32.pack(0xDEADBEEF)),  # wrong magic
        wire.handshake(1) + b"\x63",  # an unknown query type after a good start
        wire.handshake(1) + wire.request(wire.Query.SET, wire.U64.pack(2**40)),  # huge key
    ],
    ids=["http", "bad-magic", "unknown-query", "huge-length"],
)
def test_garbage_drops_that_connection_only(
    garbage: bytes, server: TCPStoreServer, connect: ClientFactory
) -> None:
    good = connect(server.port)
    with raw(server.port) as bad:
        bad.sendall(garbage)
        received = b""
        try:
            while chunk := bad.recv(4096):  # until the server closes it
                received += chunk
        except ConnectionResetError:
            pass  # closed with unread bytes: a reset instead of an EOF, dropped all the same
    assert len(received) <= 4  # at most the PING answer
    responsive(good)
    responsive(connect(server.port))


@pytest.mark.timeout(60)
def test_silent_clients_do_not_stop_others(server: TCPStoreServer, connect: ClientFactory):
    silent = [raw(server.port), handshaken(server.port), handshaken(server.port)]
    try:
        # one connected and said nothing, one validated, one stopped mid-request
        silent[2].sendall(wire.request(wire.Query.SET, wire.blob(b"/half"))[:-2])
        time.sleep(0.2)
        responsive(connect(server.port))
        responsive(connect(server.port))
    finally:
        for sock in silent:
            sock.close()


@pytest.mark.timeout(120)
def test_a_key_flood_does_not_stop_others(server: TCPStoreServer, connect: ClientFactory):
    stop = threading.Event()

    def flood() -> None:  # pipelined SETs of new keys, as fast as the socket takes them
        with handshaken(server.port) as sock:
            n = 0
            while not stop.is_set():
                sock.sendall(
                    b"".join(
                        wire.request(wire.Query.SET, wire.blob(b"/f%d" % i), wire.blob(b"v"))
                        for i in range(n, n + 500)
                    )
                )
                n += 500

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        time.sleep(0.5)
        for _ in range(5):
            responsive(connect(server.port), within=5.0)
        assert connect(server.port).num_keys() > 1000  # the flood really was being served
    finally:
        stop.set()
        flooder.join(30)


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(120)
def test_a_client_that_never_reads_is_not_buffered_for(
    server: TCPStoreServer, connect: ClientFactory
) -> None:
    writer = connect(server.port)
    writer.set("big", b"x" * (1 << 20))
    assert writer.check(["big"])  # SET has no answer: this round trip orders it first
    before = rss_bytes()
    # 300 GETs of a 1 MiB value, never read: 300 MiB of answers if the server buffered
    # them all; it stops reading this client instead.
    with handshaken(server.port) as hoarder:
        hoarder.sendall(wire.request(wire.Query.GET, wire.blob(b"/big")) * 300)
        time.sleep(1.0)
        responsive(connect(server.port))
        assert rss_bytes() - before < 64 * 1024 * 1024
        # It is paused, not dropped: reading its answers resumes it.
        hoarder.settimeout(30)
        expected, received = 300 * (8 + (1 << 20)), 0
        while received < expected and (chunk := hoarder.recv(1 << 20)):
            received += len(chunk)
        assert received == expected


@pytest.mark.timeout(60)
def test_a_closed_server_is_gone_for_its_clients(connect: ClientFactory) -> None:
    srv = TCPStoreServer(HOST, 0)
    idle, waiting = connect(srv.port), connect(srv.port)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            waiting.wait(["never"], timedelta(seconds=60))
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.3)
    srv.close()
    srv.close()  # idempotent
    with pytest.raises(RendezvousStoreGoneError) as gone:
        idle.set("k", b"v")
        idle.get("k")
    message = str(gone.value)
    assert f"{HOST}:{srv.port}" in message and "\n" not in message
    waiter.join(10)  # a parked wait learns it at once, not after its 60 s
    assert len(outcome) == 1 and isinstance(outcome[0], RendezvousStoreGoneError)
    with pytest.raises(RendezvousStoreGoneError):  # and the client stays dead
        idle.check(["k"])


@pytest.mark.timeout(30)
def test_nothing_listening_is_gone_at_once() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RendezvousStoreGoneError, match=f"{HOST}:{port}") as gone:
        TCPStoreClient(HOST, port, timeout=20)
    assert time.monotonic() - started < 2
    assert "\n" not in str(gone.value)


class SilentServer:
    """Answers the handshake, then nothing: a partition that sends no reset."""

    def __init__(self, answer_ping: bool = True) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.answer_ping = answer_ping
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return  # closed before anyone connected
        self.conns.append(conn)
        handshake = b""
        while len(handshake) < 10 and (chunk := conn.recv(10 - len(handshake))):
            handshake += chunk
        if self.answer_ping:
            conn.sendall(handshake[6:10])

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer_ping", [True, False], ids=["mid-session", "in-handshake"])
def test_a_silent_server_is_detected_in_timeout(answer_ping: bool) -> None:
    silent = SilentServer(answer_ping)
    client = None
    try:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as lost:
            client = TCPStoreClient(HOST, silent.port, timeout=1.0)
            client.add("k", 1)
        assert 0.8 < time.monotonic() - started < 10
        assert not isinstance(lost.value, RendezvousStoreGoneError)  # no answer, not gone
        assert f"{HOST}:{silent.port}" in str(lost.value) and "\n" not in str(lost.value)
    finally:
        if client is not None:
            client.close()
        silent.close()


@pytest.mark.timeout(60)
def test_server_on_a_bound_socket_and_client_close(connect: ClientFactory) -> None:
    sock = socket.socket()
    sock.bind((HOST, 0))
    with TCPStoreServer(sock=sock) as srv:
        assert srv.port == sock.getsockname()[1]
        client = connect(srv.port)
        client.set("k", b"v")
        client.close()
        client.close()  # idempotent
        with pytest.raises(RendezvousConnectionError, match="closed"):
            client.get("k")
        assert connect(srv.port).get("k") == b"v"


@pytest.mark.timeout(120)
def test_client_and_server_never_import_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer
        with TCPStoreServer("127.0.0.1", 0) as srv, TCPStoreClient("127.0.0.1", srv.port) as c:
            c.set("k", b"v")
            assert c.get("k") == b"v" and c.add("n", 2) == 2
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


class _Signalled(Exception):
    """What a signal handler raises in the middle of a request (the agent's Interrupted)."""


@contextmanager
def _raise_in(seconds: float) -> Iterator[None]:
    import signal

    def handler(signum: int, frame: object) -> None:
        raise _Signalled

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.timeout(30)
def test_a_request_interrupted_before_its_answer_never_answers_the_next(
    server: TCPStoreServer, connect: ClientFactory
) -> None:
    # A signal (SIGTERM to an agent coordinating a round) can raise between a request
    # and its answer. Read by the next request, that answer would be taken for its own
    # (here an ADD returned 1280 for 5): the client is done with, and a Connection makes
    # a new one, so the departure an agent writes next reaches the store intact.
    other = connect(server.port)
    client = connect(server.port)
    with pytest.raises(_Signalled), _raise_in(0.3):
        client.get("late")  # parked in a WAIT when the signal comes
    other.set("late", b"1")  # the server now answers the abandoned WAIT
    time.sleep(0.2)
    with pytest.raises(RendezvousConnectionError, match="interrupted"):
        client.add("n", 5)
    conn = Connection(HOST, server.port, timeout=10.0)
    try:
        with pytest.raises(_Signalled), _raise_in(0.3):
            conn.call("get", "later")
        other.set("later", b"1")
        time.sleep(0.2)
        assert conn.call("add", "n", 5) == 5
        assert conn.call("get", "late") == b"1"
    finally:
        conn.close()


def test_every_socket_of_a_client_has_the_kernel_s_timeouts(any_server: int) -> None:
    """Calls are bounded by SO_SNDTIMEO/SO_RCVTIMEO (the client's sockets are blocking),
    on every kind of server, including a torch server's second connection (a torch server
    closes the first, which asks for the token handshake)."""
    with TCPStoreClient(HOST, any_server, timeout=3.0) as client:
        client.set("k", b"v")
        assert client.get("k") == b"v"
        sock = client._sock
        assert sock.gettimeout() is None  # blocking: one syscall per recv
        for option in (socket.SO_SNDTIMEO, socket.SO_RCVTIMEO):
            sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, 16))
            assert 0 < sec + usec / 1e6 <= 3.0, (option, sec, usec)
