"""What ``bench/fuzz.py`` fuzzes: one function per parser of untrusted bytes.

Over 400 lines on purpose: this file is the registry, one decorated function per target
(each 20-70 lines with its checks), so that reading it lists every parser the fuzzer
covers and a parser without a target shows as an absence here; ``fuzz.py --list``, and
through it ``tests/test_fuzz.py``, take its ``TARGETS`` as the set. Splitting the targets
across files would split that list. What is not a target lives beside it
(``fuzz_etcd_transport.py``: the stand-in for urllib3's pool under the etcd clients).

Each target is registered by name with ``@target``: a setup function, run once in the
fuzzing process (after coverage instrumentation is on), that returns the function called
with every input. That function returns normally for any input whose outcome is allowed
(the parsed value, or the parser's documented refusal) and raises anything else: an
exception escaping it is a crash. Adding a target (the presence hello, say) is one more
decorated function here and a seed directory in ``tests/fuzz_corpus/<name>/``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from fuzz_etcd_transport import Pool, answer_every_op, reads_and_writes

OneInput = Callable[[bytes], None]


@dataclass(frozen=True)
class Target:
    name: str
    doc: str
    setup: Callable[[], OneInput]


TARGETS: dict[str, Target] = {}


def target(name: str) -> Callable[[Callable[[], OneInput]], Callable[[], OneInput]]:
    def register(setup: Callable[[], OneInput]) -> Callable[[], OneInput]:
        doc = " ".join((setup.__doc__ or "").split("\n\n")[0].split())
        TARGETS[name] = Target(name, doc, setup)
        return setup

    return register


class Crash(AssertionError):
    """An input broke a rule the parser promises (not an exception it escaped with)."""


class _Errors(logging.Handler):
    """Records logged at ERROR or above: a server logs a bug a request triggered there."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


TOKEN = b"fuzz-token"
RUN_ID = "fuzz"


# --- the store server ------------------------------------------------------------------


@target("store-request")
def store_request() -> OneInput:
    """TCPStore request parser (wire.RequestParser): bytes cut at fuzzed places."""
    from elastic.core.tcpstore import wire

    caps = (wire.VALIDATE_LEN, wire.AUTH_REQUEST_LEN, 4096, wire.MAX_REQUEST_LEN)

    def one(data: bytes) -> None:
        if len(data) < 2:
            return
        parser = wire.RequestParser(max_len=caps[data[0] % len(caps)])
        step = data[1] % 16 + 1
        body = data[2:]
        try:
            for start in range(0, len(body), step):
                parser.feed(body[start : start + step])
                while (req := parser.next()) is not None:
                    if not isinstance(req.query, wire.Query):
                        raise Crash(f"parsed a query outside the protocol: {req!r}")
        except wire.ProtocolError:
            return  # the server drops the connection: the refusal
        if parser.buffered > len(body):
            raise Crash("buffered more than was fed")

    return one


@target("store-session")
def store_session() -> OneInput:
    """Our TCPStore server with a token: one connection per input (raw, after VALIDATE, or
    after the token handshake), fuzzed requests in sequence on it (its state machine)."""
    from elastic.core.tcpstore import TCPStoreServer, wire

    errors = _Errors()
    logging.getLogger("elastic.core.tcpstore.server").addHandler(errors)
    server = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    count = [0]

    def recv_exactly(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def handshake(sock: socket.socket, mode: int) -> None:
        if mode == 0:
            return
        sock.sendall(wire.handshake(7))
        recv_exactly(sock, 4)  # the PING's echo
        if mode == 1:
            return
        ours = b"c" * wire.AUTH_CHALLENGE_LEN  # the mutual handshake (wire): server first
        sock.sendall(wire.request(wire.Query.AUTH_HELLO, wire.blob(ours)))
        (n,) = wire.U64.unpack(recv_exactly(sock, 8))
        theirs = recv_exactly(sock, n)
        (n,) = wire.U64.unpack(recv_exactly(sock, 8))
        if recv_exactly(sock, n) != wire.auth_proof(TOKEN, wire.SERVER, ours, theirs):
            raise Crash("the server did not prove the token")
        proof = wire.auth_proof(TOKEN, wire.CLIENT, ours, theirs)
        sock.sendall(wire.request(wire.Query.AUTH_PROOF, wire.blob(proof)))
        if recv_exactly(sock, 1) != wire.U8.pack(wire.AUTHENTICATED):
            raise Crash("the server refused the right token")

    def one(data: bytes) -> None:
        if not data:
            return
        count[0] += 1
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            handshake(sock, data[0] % 3)
            try:
                sock.sendall(data[1:])
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):  # until the server closes it: it must, at EOF
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass  # dropped mid-send: a refusal
            except TimeoutError:
                raise Crash("the server kept a half-closed connection open") from None
        if errors.records:
            raise Crash(f"the server logged an error: {errors.records[0].getMessage()}")
        if count[0] % 64 == 0:  # still serving an authenticated client
            from elastic.core.tcpstore import TCPStoreClient

            client = TCPStoreClient("127.0.0.1", server.port, timeout=5, token=TOKEN)
            client.set("alive", "1")
            if client.get("alive") != b"1":
                raise Crash("the server stopped serving")
            client.close()

    return one


# --- records and signatures ------------------------------------------------------------


def _record_parsers() -> Callable[[bytes], None]:
    """Every reader of a rendezvous record's value: a value or RendezvousStateError."""
    from elastic.core.interfaces.failures import FailureRecord
    from elastic.core.interfaces.job_keys import parse_budget
    from elastic.core.interfaces.rendezvous import RendezvousStateError
    from elastic.core.rendezvous.round import presence
    from elastic.core.rendezvous.round import records as R
    from elastic.core.rendezvous.round.liveness import parse_lost
    from elastic.core.rendezvous.round.progress_lines import Forming
    from elastic.core.rendezvous.round.signing import parse_counter

    def parse_all(value: bytes) -> None:
        R.closed_at(value)
        parse_counter(value)
        forming = Forming.from_json(value)
        if forming is not None:
            forming.line(1.0)
        try:  # its one reader skips a record that fails, whatever the exception
            FailureRecord.from_json(value)
        except Exception:  # noqa: BLE001
            pass
        for parse in (
            lambda: R.Assignment.from_json(value, "k", 0).rank_of(1),
            lambda: R.Roster.from_json(value, "k", 0),
            lambda: parse_lost(value, "k"),
            lambda: parse_budget(value),
            lambda: R.valid_join(R.loads(value, "k"), 0),
            lambda: presence.read_hello(TOKEN, RUN_ID, value, "nonce", 0),
            lambda: R.counter(value, "k"),
        ):
            try:
                parse()
            except RendezvousStateError:
                pass

    return parse_all


@target("signed-record")
def signed_record() -> OneInput:
    """A store value as the round reads it: signature and version (signing.py) through a
    real store, then every record reader; a sealed variant reaches the readers too."""
    from elastic.core.interfaces.rendezvous import RendezvousStateError
    from elastic.core.rendezvous.round.signing import SignedStore, seal, unseal, unseal_versioned
    from elastic.core.tcpstore import TCPStoreServer
    from elastic.core.tcpstore.view import Connection, PrefixStore

    server = TCPStoreServer("127.0.0.1", 0)
    inner = PrefixStore(Connection("127.0.0.1", server.port, 5.0), "elastic/fuzz/")
    keys = ("agent/failed", "agent/restart_budget", "rdzv/r/0/assignment", "rdzv/events", "x")
    parse_all = _record_parsers()

    def one(data: bytes) -> None:
        if not data:
            return
        key, raw = keys[data[0] % len(keys)], data[1:]
        unseal(TOKEN, RUN_ID, key, raw)
        unseal_versioned(TOKEN, RUN_ID, key, raw)
        store = SignedStore(inner, TOKEN, RUN_ID)  # a fresh node: no version seen yet
        inner.set(key, raw)
        store.read([key])
        store.check([key])
        if data[0] & 0x80:  # a node that wrote a value, then reads the fuzzed bytes there
            store.set(key, b"1")
            inner.set(key, raw)
            deciding = key.startswith("agent/")  # no one can sign a newer value than its own
            if deciding and store.read([key]) != [b"1"]:
                raise Crash(f"{key}: a node went back from the value it wrote")
        try:
            store.compare_set(key, b"", b"new")
        except RendezvousStateError:
            pass
        parse_all(raw)
        parse_all(unseal(TOKEN, RUN_ID, key, seal(TOKEN, RUN_ID, key, raw)) or b"")

    return one


@target("replay")
def replay() -> OneInput:
    """Sequences of decisions by three nodes and of replays, deletions and garbage by a
    client without the token, on a real store: no node ever reads a deciding record older
    than one it has read (restarts used, the failed flag, a lost list).

    One limit is not checked: once the attacker deleted a record (or overwrote it with
    garbage, which reads as absent), a node that never read it starts it again from
    absent, and its write is newer than any before (docs/security.md). So restarts used
    and a lost list are checked to never go back only in inputs without a deletion; the
    failed flag always."""
    from elastic.core.agent.restarts import claim_restart, job_failed, restarts_used
    from elastic.core.interfaces.job_keys import BUDGET_KEY, FAILED_KEY
    from elastic.core.rendezvous.round.liveness import add_lost, read_lost
    from elastic.core.rendezvous.round.signing import SignedStore
    from elastic.core.tcpstore import TCPStoreServer
    from elastic.core.tcpstore.view import Connection, PrefixStore

    server = TCPStoreServer("127.0.0.1", 0)
    conn = Connection("127.0.0.1", server.port, 5.0)
    lost = "rdzv/r/0/lost"
    keys = (BUDGET_KEY, FAILED_KEY, lost)
    runs = [0]

    def one(data: bytes) -> None:
        runs[0] += 1
        raw = PrefixStore(conn, f"elastic/replay-{runs[0]}/")  # a fresh job per input
        nodes = [SignedStore(raw, TOKEN, RUN_ID) for _ in range(3)]
        seen: list[tuple[int, bool, set[str]]] = [(0, False, set()) for _ in nodes]
        taken: list[bytes] = []  # values the attacker copied
        erased = False  # the attacker deleted or overwrote with garbage
        for i in range(0, len(data) - 1, 2):
            op, arg = data[i] % 8, data[i + 1]
            node = nodes[arg % 3]
            key = keys[arg % len(keys)]
            if op == 0:
                claim_restart(node, arg % 5, "n")
            elif op == 1:
                node.set(FAILED_KEY, "1")
            elif op == 2:
                add_lost(node.sub("rdzv/"), 0, [f"m{arg % 4}"])
            elif op == 3:
                taken.append(bytes(raw.multi_get([key])[0]))
            elif op == 4 and taken:
                raw.set(keys[arg % len(keys)], taken[arg % len(taken)])
            elif op == 5:
                raw.delete_key(key)
                erased = True
            elif op == 6:
                raw.set(key, bytes(data[i + 1 :][:40]))
                erased = True
            else:  # every node reads, and must not have gone back
                for n, (node_, (used, failed, gone)) in enumerate(zip(nodes, seen, strict=True)):
                    now = (
                        restarts_used(node_),
                        job_failed(node_),
                        set(read_lost(node_.sub("rdzv/"), 0)),
                    )
                    back = not erased and (now[0] < used or not gone <= now[2])
                    if back or (failed and not now[1]):
                        raise Crash(f"node {n} went back: {(used, failed, gone)} -> {now}")
                    seen[n] = now

    return one


# --- etcd ------------------------------------------------------------------------------


@target("etcd-v3-reply")
def etcd_v3_reply() -> OneInput:
    """etcd v3 JSON gateway replies (client.py, store.py): every store operation and a
    watch stream parse the fuzzed body; RendezvousError is the refusal."""
    from elastic.core.interfaces.rendezvous import RendezvousError
    from elastic.core.interfaces.store import StoreTimeoutError
    from elastic.plugins.rdzv_etcd_v3.client import V3Config
    from elastic.plugins.rdzv_etcd_v3.store import EtcdV3Store

    config = V3Config("127.0.0.1:1", read_timeout=0.05, retry_timeout=0.001)
    store = EtcdV3Store(config, "/fuzz/", lease_ttl=5, timeout=timedelta(seconds=0.01))
    pool = Pool()
    store._conn.client._pool = pool  # noqa: SLF001  (the transport is the fuzzer)

    ops: tuple[Callable[[], object], ...] = (
        *reads_and_writes(store),
        lambda: store.delete_key("a"),
        lambda: store.get("a"),
        lambda: store.heartbeat("h", b"1"),
    )
    # a watch stream too (a failed one pauses 50 ms)
    slow = (lambda: list(store._conn.client.watch(b"a", b"b", 1, 0.05)),)  # noqa: SLF001

    def one(data: bytes) -> None:
        answer_every_op(pool, data, ops, slow, (RendezvousError, StoreTimeoutError))
        store._conn.lease._id = None  # noqa: SLF001  (grant again: parse that reply too)

    return one


@target("etcd-v2-reply")
def etcd_v2_reply() -> OneInput:
    """etcd v2 replies as python-etcd and our store read them (plugins/rdzv_etcd)."""
    import etcd
    from elastic.core.interfaces.rendezvous import RendezvousError
    from elastic.core.interfaces.store import StoreTimeoutError
    from elastic.plugins.rdzv_etcd.client import ClientConfig, EtcdClient
    from elastic.plugins.rdzv_etcd.store import EtcdStore

    client = EtcdClient(ClientConfig("127.0.0.1:1", read_timeout=0.05, retry_timeout=0.001))
    pool = Pool()
    for member in client._clients:  # noqa: SLF001  (the transport is the fuzzer)
        member.http = pool
    store = EtcdStore(client, "/fuzz", timeout=timedelta(seconds=0.01))

    ops: tuple[Callable[[], object], ...] = (
        *reads_and_writes(store),
        lambda: store.check(["a"]),
        lambda: store.delete_key("a"),
        lambda: store.get("a"),
    )
    slow = (  # waits and watches too (a failed one pauses)
        lambda: store.wait(["a"], timedelta(seconds=0.01)),
        lambda: client.watch("/fuzz/a", None, 0.01),
    )
    # python-etcd's own errors are its logical outcomes (not found...)
    refusals = (RendezvousError, StoreTimeoutError, etcd.EtcdException)

    def one(data: bytes) -> None:
        answer_every_op(pool, data, ops, slow, refusals)

    return one


# --- the node's own files and settings -------------------------------------------------


@target("control-file")
def control_file() -> OneInput:
    """The control file as a worker maps and reads it, and the round file beside it."""
    from elastic.core.workers import control_file as cf
    from elastic.training import control

    directory = tempfile.mkdtemp(prefix="elastic-fuzz-control-")
    path = os.path.join(directory, "control")

    def one(data: bytes) -> None:
        if not data:
            return
        slot = struct.unpack("<b", data[:1])[0]  # negative ones too
        with open(path, "wb") as f:
            f.write(data[1:])
        os.environ[cf.ENV_CONTROL], os.environ[cf.ENV_CONTROL_SLOT] = path, str(slot)
        control.reset_for_tests()
        try:
            if control.available():
                for field in range(3):
                    control.header(field)
                for field in range(cf.SLOT.size // 8):
                    control.mine(field)
        finally:
            control.reset_for_tests()
        found = cf.parse_round(data[1:], slot, 0)
        if found is not None and not (isinstance(found[0], int) and found[0] > 0):
            raise Crash(f"a round file read as generation {found[0]!r}")

    return one


@target("slurm-hostlist")
def slurm_hostlist() -> OneInput:
    """SLURM's hostlist and the step's environment (cli/slurm.py): hosts or SlurmError."""
    from elastic.cli import slurm

    names = (
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "SLURM_PROCID",
        "SLURM_NNODES",
        "SLURM_JOB_NODELIST",
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_NODEID",
    )

    def one(data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        try:
            hosts = slurm.expand_hostlist(text)
            if len(hosts) > slurm.MAX_HOSTS:
                raise Crash(f"{len(hosts)} hosts")
        except slurm.SlurmError:
            pass
        values = text.split("\0")
        env = {name: values[i % len(values)] for i, name in enumerate(names)}
        try:
            step = slurm.detect(env)
            if step is not None:
                _ = step.port, step.tasks_per_node()
        except slurm.SlurmError:
            pass

    return one


@target("rdzv-conf")
def rdzv_conf() -> OneInput:
    """``--rdzv-conf`` through its parser and the round's settings (no token file)."""
    import click
    from elastic.cli.options import parse_rdzv_conf
    from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousParameters
    from elastic.core.rendezvous.round.settings import parse_round_settings

    def one(data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        try:
            config = parse_rdzv_conf(text)
            config.pop("token_file", None)  # names a file: not this target's input
            params = RendezvousParameters("c10d", "127.0.0.1:1", "job", 1, 2, config=config)
            parse_round_settings(params, ("store_type",))
        except (click.BadParameter, RendezvousConfigError):
            pass

    return one
