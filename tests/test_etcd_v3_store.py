"""EtcdV3Store against real etcd servers serving only the v3 API: every operation, atomicity
under racing threads and stores, watch wake-up, leases (a SIGKILLed client's heartbeat
vanishes; a lost lease is replaced and counted), TLS and v3 auth, a 3-member cluster
losing its leader mid-test, a lost reply, unreachable endpoints."""

from __future__ import annotations

import re
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.rendezvous import (
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreGoneError,
)
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.plugins.rdzv_etcd_v3.client import EtcdV3AuthError, V3Config
from elastic.plugins.rdzv_etcd_v3.store import CONNECTION_KEYS, EtcdV3Store, store_from_params
from elastic.testing.etcd import V3_TOKEN_TTL, free_port, gateway_post, sign_cert

if TYPE_CHECKING:
    from elastic.harness.processes import Processes
    from elastic.testing.etcd import EtcdCluster, EtcdMember

pytest_plugins = ["elastic.testing.etcd"]
pytestmark = pytest.mark.timeout(60)

TTL = 2.0


class Stores:
    """Makes stores and closes them at teardown, whatever the test did."""

    def __init__(self) -> None:
        self.made: list[EtcdV3Store] = []

    def __call__(self, endpoint: str, prefix: str = "/t/", **conf: Any) -> EtcdV3Store:
        ttl = conf.pop("lease_ttl", TTL)
        store = EtcdV3Store(V3Config(endpoint, **conf), prefix, lease_ttl=ttl)
        self.made.append(store)
        return store

    def close(self) -> None:
        for store in self.made:
            store.close()


@pytest.fixture
def stores() -> Iterator[Stores]:
    made = Stores()
    yield made
    made.close()


def started(member: EtcdMember, method: str) -> int:
    """How many ``method`` requests (Txn, Watch, ...) the member has served."""
    with urllib.request.urlopen(f"{member.client_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = re.search(rf'grpc_server_started_total{{grpc_method="{method}"[^}}]*}} (\d+)', text)
    return int(found.group(1)) if found else 0


def test_v2_api_is_off_and_v3_answers(etcd_v3_server: EtcdCluster) -> None:
    member = etcd_v3_server.members[0]
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{member.client_url}/v2/keys/", timeout=5)
    assert info.value.code == 404
    assert "header" in gateway_post(member, "kv/range", {"key": "YQ=="})


def test_every_operation(etcd_v3_server_shared: EtcdCluster, stores: Stores) -> None:
    store = stores(etcd_v3_server_shared.endpoint, "/ops/")
    store.timeout = timedelta(seconds=0.5)
    assert isinstance(store, CoordinationStore)
    assert store.prefix == "/ops/" and store.where == etcd_v3_server_shared.endpoint

    store.set("a", "1")
    store.set("b", b"\x00\xffbin")
    assert store.get("a") == b"1" and store.get("b") == b"\x00\xffbin"
    assert store.check(["a", "b"]) and store.check([]) and not store.check(["a", "nope"])
    assert store.multi_get(["b", "nope", "a"]) == [b"\x00\xffbin", b"", b"1"]
    with pytest.raises(StoreTimeoutError, match="/ops/nope"):
        store.get("nope")

    assert store.add("n", 0) == 0
    assert [store.add("n", 1), store.add("n", 5), store.add("n", -2), store.add("n", 0)] == [
        1, 6, 4, 4,
    ]  # fmt: skip
    store.set("text", "x")
    with pytest.raises(RendezvousStateError, match="/ops/text"):
        store.add("text", 1)

    assert store.compare_set("cs", "", "first") == b"first"
    assert store.compare_set("cs", "", "second") == b"first"  # exists: refused, current back
    assert store.compare_set("cs", "wrong", "third") == b"first"
    assert store.compare_set("cs", "first", "fourth") == b"fourth"
    assert store.compare_set("absent", "x", "y") == b"x"  # absent and expected != "": as torch
    assert not store.check(["absent"])

    assert store.delete_key("a") and not store.delete_key("a")
    assert not store.check(["a"])

    sub = store.sub("inner/")
    assert sub.prefix == "/ops/inner/" and isinstance(sub, CoordinationStore)
    sub.set("k", "v")
    assert store.get("inner/k") == b"v" and sub.add("c", 2) == 2 == store.add("inner/c", 0)

    many = [f"m/{i:03d}" for i in range(300)]  # more than one txn's worth (128 ops)
    for key in many:
        store.set(key, key)
    assert store.multi_get(many) == [k.encode() for k in many] and store.check(many)

    store.close()
    store.close()  # idempotent
    with pytest.raises(RendezvousConnectionError, match="closed"):
        sub.get("k")  # views share the connection


def test_add_is_atomic_across_threads_and_stores(
    etcd_v3_server_shared: EtcdCluster, stores: Stores
) -> None:
    pair = [stores(etcd_v3_server_shared.endpoint, "/atomic/") for _ in range(2)]
    per_thread = 25

    def bump(i: int) -> list[int]:
        return [pair[i % 2].add("counter", 1) for _ in range(per_thread)]

    with ThreadPoolExecutor(8) as pool:
        seen = [v for got in pool.map(bump, range(8)) for v in got]
    assert sorted(seen) == list(range(1, 8 * per_thread + 1))  # each value handed out once
    assert pair[0].add("counter", 0) == 8 * per_thread


def test_compare_set_has_exactly_one_winner(
    etcd_v3_server_shared: EtcdCluster, stores: Stores
) -> None:
    pair = [stores(etcd_v3_server_shared.endpoint, "/cas/") for _ in range(2)]
    names = [f"node{i}" for i in range(8)]

    def claim(store: EtcdV3Store, go: threading.Barrier, key: str, me: str) -> bytes:
        go.wait()  # all racers at once
        return store.compare_set(key, "", me)

    for rnd in range(5):
        go = threading.Barrier(8)
        racers = [pair[i % 2] for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            held = list(pool.map(claim, racers, [go] * 8, [f"owner{rnd}"] * 8, names))
        winners = [me for me, got in zip(names, held, strict=True) if got == me.encode()]
        assert len(winners) == 1, held
        assert set(held) == {winners[0].encode()}


def test_wait_wakes_promptly_without_polling(etcd_v3_server: EtcdCluster, stores: Stores) -> None:
    waiter = stores(etcd_v3_server.endpoint, "/w/")
    writer = stores(etcd_v3_server.endpoint, "/w/")
    set_at: dict[str, float] = {}

    def write_later() -> None:
        time.sleep(0.3)
        writer.set("a", "1")
        time.sleep(0.3)
        writer.set("b", "2")
        set_at["b"] = time.monotonic()

    member = etcd_v3_server.members[0]
    thread = threading.Thread(target=write_later)
    thread.start()
    waiter.wait(["a", "b"], timedelta(seconds=20))
    woke = time.monotonic()
    thread.join()
    assert woke - set_at["b"] < 0.5, f"woke {woke - set_at['b']:.3f}s after the last set"

    # A get blocks until another client writes the key.
    threading.Timer(0.3, writer.set, ("late", "v")).start()
    assert waiter.get("late") == b"v"

    # Timing out: a watch, then one re-read, not a polling loop.
    txns_before = started(member, "Txn")
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="/w/never"):
        waiter.wait(["never"], timedelta(seconds=2))
    assert 2.0 <= time.monotonic() - t0 < 3.5
    assert started(member, "Txn") - txns_before <= 2


def test_heartbeat_vanishes_when_its_client_is_killed(
    etcd_v3_server: EtcdCluster, stores: Stores, procs: Processes
) -> None:
    script = (
        "import sys, time\n"
        "from elastic.plugins.rdzv_etcd_v3.client import V3Config\n"
        "from elastic.plugins.rdzv_etcd_v3.store import EtcdV3Store\n"
        f"s = EtcdV3Store(V3Config(sys.argv[1]), '/hb/', lease_ttl={TTL})\n"
        "s.heartbeat('alive/node0', 'beat')\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = procs.start([sys.executable, "-c", script, etcd_v3_server.endpoint])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    observer = stores(etcd_v3_server.endpoint, "/hb/")
    time.sleep(TTL * 1.5)  # longer than the TTL: only the keepalive thread keeps it
    assert observer.get("alive/node0") == b"beat"

    proc.kill()  # SIGKILL: no close(), no revoke
    proc.wait(timeout=10)
    killed = time.monotonic()
    while observer.check(["alive/node0"]):
        assert time.monotonic() - killed < TTL + 2, "heartbeat outlived its lease"
        time.sleep(0.05)


def test_lost_lease_is_replaced_and_counted(etcd_v3_server: EtcdCluster, stores: Stores) -> None:
    store = stores(etcd_v3_server.endpoint, "/lease/")
    store.heartbeat("me", "1")
    first = store.lease_id
    assert store.lease_lost_count == 0
    gateway_post(etcd_v3_server.members[0], "lease/revoke", {"ID": str(first)})
    assert not store.check(["me"])  # revoking took the key with it

    deadline = time.monotonic() + TTL + 2
    while store.lease_lost_count == 0:
        assert time.monotonic() < deadline, "the keeper never noticed the lease was gone"
        time.sleep(0.05)
    assert store.lease_lost_count == 1 and store.lease_id != first
    assert not store.check(["me"])  # not silently resurrected: the round decides
    store.heartbeat("me", "2")
    time.sleep(TTL * 1.5)
    assert store.get("me") == b"2" and store.lease_lost_count == 1


def test_tls_and_auth(etcd_v3_tls_auth: EtcdCluster, stores: Stores) -> None:
    member = etcd_v3_tls_auth.members[0]
    tls = member.tls
    assert tls is not None
    conf = {"protocol": "https", "ca_cert": tls.ca_cert, "ssl_cert": tls.client_cert,
            "ssl_cert_key": tls.client_key, "username": "root", "password": "secret"}  # fmt: skip
    params = RendezvousParameters("etcd-v3", member.endpoint, "job", 1, 1, config=conf)
    store = store_from_params(params, "/secure/", lease_ttl=TTL)
    stores.made.append(store)
    store.set("a", "1")
    assert store.add("n", 3) == 3 and store.compare_set("o", "", "x") == b"x"
    store.heartbeat("hb", "1")
    threading.Timer(0.3, store.set, ("later", "v")).start()
    store.wait(["later"], timedelta(seconds=10))

    # Tokens expire on this server after V3_TOKEN_TTL idle seconds: the store authenticates
    # again (a token fetched now, and rejected after the pause, proves they did expire).
    login = {"name": "root", "password": "secret"}
    token = str(gateway_post(member, "auth/authenticate", login)["token"])
    time.sleep(V3_TOKEN_TTL + 1.5)
    with pytest.raises(urllib.error.HTTPError) as info:
        gateway_post(member, "kv/range", {"key": "YQ=="}, token=token)
    assert info.value.code == 401
    assert store.get("a") == b"1" and store.add("n", 1) == 4
    threading.Timer(0.3, store.set, ("later2", "v")).start()
    store.wait(["later2"], timedelta(seconds=10))
    assert store.check(["hb"])  # the lease kept alive throughout

    # The v1 backend's key names work too; refusals are immediate, one line, not retried.
    base = {"protocol": "https", "cacert": tls.ca_cert, "cert": tls.client_cert,
            "key": tls.client_key}  # fmt: skip
    named = sign_cert(Path(tls.ca_cert).parent, "named-client", "/CN=named")
    cases = [
        ({**base, "username": "root", "password": "wrong"}, "refused user 'root'"),
        (base, r"for user \(none\): etcdserver: permission denied"),
        # etcd answers a missing certificate with an alert or, racing it, a closed socket
        ({**conf, "ssl_cert": "", "ssl_cert_key": ""}, "ALERT_BAD_CERTIFICATE|client certificate"),
        ({**conf, "ca_cert": tls.other_ca_cert}, "TLS connection.*CERTIFICATE_VERIFY_FAILED"),
        ({**conf, "ca_cert": f"{tls.ca_cert}.missing"}, "TLS connection.*No such file"),
        ({**conf, "ssl_cert": named[0], "ssl_cert_key": named[1]}, "CommonName"),
    ]
    for config, message in cases:
        params = RendezvousParameters("etcd-v3", member.endpoint, "job", 1, 1, config=config)
        bad = store_from_params(params, "/secure/", lease_ttl=TTL)
        stores.made.append(bad)
        t0 = time.monotonic()
        with pytest.raises(EtcdV3AuthError, match=message) as caught:
            bad.get("a")
        assert time.monotonic() - t0 < 5 and "\n" not in str(caught.value)


def leader_first(cluster: EtcdCluster) -> list[EtcdMember]:
    status = gateway_post(cluster.members[0], "maintenance/status", {})
    ids = {m.name: gateway_post(m, "maintenance/status", {})["header"]["member_id"]
           for m in cluster.members}  # fmt: skip
    return sorted(cluster.members, key=lambda m: ids[m.name] != status["leader"])


@pytest.mark.timeout(120)
def test_cluster_loses_its_leader_mid_test(etcd_v3_cluster: EtcdCluster, stores: Stores) -> None:
    members = leader_first(etcd_v3_cluster)  # `store` talks to the leader first
    # A proposal caught by the election is answered only after etcd's request timeout
    # (here 5 s + 2 x 500 ms); read_timeout cuts such a request short, to retry elsewhere.
    read_timeout = 2.0
    endpoint = ",".join(m.endpoint for m in members)
    store = stores(endpoint, "/ha/", read_timeout=read_timeout)
    other = stores(",".join(m.endpoint for m in reversed(members)), "/ha/", read_timeout=2.0)
    store.heartbeat("alive/a", "1")
    other.heartbeat("alive/b", "1")
    stop = threading.Event()
    slowest = [0.0]

    def bump(i: int) -> list[int]:
        got = []
        while not stop.is_set():
            t0 = time.monotonic()
            got.append((store if i % 2 else other).add("counter", 1))
            slowest[0] = max(slowest[0], time.monotonic() - t0)
        return got

    def wait_across_the_kill() -> float:
        store.wait(["after"], timedelta(seconds=30))  # watching the member that dies
        return time.monotonic()

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(bump, i) for i in range(4)]
        waiter = pool.submit(wait_across_the_kill)
        time.sleep(1.0)
        members[0].kill()  # the leader, and the member `store` was talking to
        time.sleep(3.0)
        stop.set()
        other.set("after", "1")
        set_at = time.monotonic()
        assert waiter.result(timeout=30) - set_at < 1.0, "the wait did not survive the kill"
        seen = [v for f in futures for v in f.result(timeout=60)]
    assert sorted(seen) == list(range(1, len(seen) + 1))  # exactly once, through the kill
    assert store.add("counter", 0) == len(seen)
    assert slowest[0] < 2 * read_timeout + 1, f"an add took {slowest[0]:.1f}s"

    # Everything else goes on against the two survivors.
    assert store.compare_set("owner", "", "a") == b"a" == other.compare_set("owner", "", "b")
    threading.Timer(0.3, other.set, ("late", "v")).start()
    store.wait(["late"], timedelta(seconds=10))
    assert store.multi_get(["owner", "late"]) == [b"a", b"v"]
    time.sleep(TTL * 1.5)
    assert store.check(["alive/a", "alive/b"])  # both leases were kept alive throughout
    assert store.lease_lost_count == other.lease_lost_count == 0


class DropOneReply:
    """A loopback TCP proxy to one etcd member that, once armed, forwards the next
    ``kv/txn`` request and closes the connection instead of relaying its reply: the
    write is applied but its outcome is unknown to the client."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream))
        drop = False
        with client, upstream:
            while True:
                ready, _, _ = select.select([client, upstream], [], [])
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        return
                    if self.armed.is_set() and b"/v3/kv/txn" in data:
                        self.armed.clear()
                        drop = True
                    upstream.sendall(data)
                if upstream in ready:
                    data = upstream.recv(65536)
                    if drop:
                        self.dropped.set()
                    if not data or drop:
                        return
                    client.sendall(data)

    def close(self) -> None:
        self.listener.close()


def test_an_add_whose_reply_is_lost_counts_once(
    etcd_v3_server: EtcdCluster, stores: Stores
) -> None:
    proxy = DropOneReply(etcd_v3_server.members[0].client_port)
    try:
        store = stores(f"127.0.0.1:{proxy.port}", "/lost/")
        for amount, expected in ((1, 1), (5, 6)):  # creating the counter, then bumping it
            proxy.armed.set()
            proxy.dropped.clear()
            assert store.add("n", amount) == expected
            assert proxy.dropped.is_set()
            assert store.add("n", 0) == expected
        proxy.armed.set()
        proxy.dropped.clear()
        assert store.compare_set("owner", "", "me") == b"me"  # we won, though the reply was lost
        assert proxy.dropped.is_set()
    finally:
        proxy.close()


def test_nothing_listening_fails_in_bounded_time(stores: Stores) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    store = stores(endpoint, retry_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(RendezvousStoreGoneError) as info:
        store.set("a", "1")
    assert time.monotonic() - t0 < 3.0
    assert endpoint in str(info.value) and "\n" not in str(info.value)


def test_a_silent_member_fails_in_bounded_time(stores: Stores) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        store = stores(endpoint, read_timeout=0.3, retry_timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as info:
            store.get("a")
        assert time.monotonic() - t0 < 3.0
        assert not isinstance(info.value, RendezvousStoreGoneError)  # a partition, not gone
        assert endpoint in str(info.value)


def test_tls_hung_up_on_by_every_member_is_not_retried(stores: Stores) -> None:
    """A handshake closed without a word is retried (a member may have crashed in it), but
    the same on every member, twice, is a refusal of our TLS setup."""
    with socket.create_server(("127.0.0.1", 0)) as server:

        def hang_up() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:  # the listener closed: the test is over
                    return
                conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        port = server.getsockname()[1]
        store = stores(f"127.0.0.1:{port}", protocol="https", retry_timeout=20.0)
        t0 = time.monotonic()
        with pytest.raises(EtcdV3AuthError, match="require a client certificate"):
            store.get("a")
        assert time.monotonic() - t0 < 2.0


def test_store_from_params_reads_the_connection_keys() -> None:
    config = {"read_timeout": "2.5", "retry_timeout": "4", "join_timeout": "9"}
    params = RendezvousParameters("etcd-v3", "https://127.0.0.1:1,127.0.0.1:2", "j", 1, 1,
                                  config=config)  # fmt: skip
    store = store_from_params(params, "/p/", lease_ttl=3)  # unknown keys are not its business
    try:
        assert store.config.protocol == "https" and store.where == "127.0.0.1:1,127.0.0.1:2"
        assert (store.config.read_timeout, store.config.retry_timeout) == (2.5, 4.0)
        assert store.lease_ttl == 3 and store.prefix == "/p/"
    finally:
        store.close()
    assert {"protocol", "ca_cert", "cacert", "ssl_cert", "username"} <= set(CONNECTION_KEYS)
    bad = RendezvousParameters("etcd-v3", "h:1", "j", 1, 1, config={"protocol": "ftp"})
    with pytest.raises(RendezvousConfigError, match="protocol"):
        store_from_params(bad, "/p/", lease_ttl=3)


def test_importing_the_package_is_cheap() -> None:
    code = (
        "import sys, elastic.plugins.rdzv_etcd_v3 as p\n"
        "assert 'urllib3' not in sys.modules and 'torch' not in sys.modules\n"
        "assert p.EtcdV3Store.__name__ == 'EtcdV3Store'\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
