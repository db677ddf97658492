"""The round monitor's fencing clock, against a real store server: a node fences itself
only when the store leaves its requests unanswered *and* the store's host is silent too
(a partition), never because its own thread ran late (hundreds of agents starting on a
few cores) nor because the store is slow (its host starved of CPU, its process paused).
The last two cases run on a simulated two-host network (``elastic.harness.cluster``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from elastic.core.interfaces.rendezvous import RendezvousStateError
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.monitor import Monitor
from elastic.core.tcpstore import TCPStoreServer
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.harness.cluster import Cluster

pytest_plugins = ["elastic.testing.etcd"]

HOST = "127.0.0.1"
WHERE = "the test store"
INTERVAL, TIMEOUT = 0.2, 1.0

SERVER = """\
import sys, time
from elastic.core.tcpstore import TCPStoreServer
server = TCPStoreServer(sys.argv[1], 0)
print(server.port, flush=True)
time.sleep(600)
"""

# A member's monitor (node "b", rank 1 of a round with "a") against the store at ARGV;
# prints "ready", then one JSON line each time ``fenced`` changes, for SECONDS.
MEMBER = f"""\
import json, sys, time
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.monitor import Monitor
from elastic.core.tcpstore.view import Connection, PrefixStore
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
store = PrefixStore(Connection(host, port, timeout=30.0), "job/")
store.heartbeat("rdzv/" + R.hb_key("a"), "1 0")
monitor = Monitor(store, "b", interval={INTERVAL}, timeout={TIMEOUT})
monitor.set_round(R.Assignment(round=0, state="formed", size=2, first="a"), rank=1)
monitor.start()
print("ready", flush=True)
end, last = time.time() + seconds, None
while time.time() < end:
    why = monitor.fenced("{WHERE}")
    if (why is None) != (last is None):
        print(json.dumps({{"t": time.time(), "fenced": why}}), flush=True)
    last = why
    time.sleep(0.05)
"""


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
    store.heartbeat("rdzv/" + R.hb_key("a"), "1 0")
    monitor = Monitor(store, "b", interval=interval, timeout=timeout)
    monitor.set_round(R.Assignment(round=0, state="formed", size=2, first="a"), rank=1)
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


def two_hosts(make: Callable[..., Cluster], seconds: float) -> tuple[Cluster, Any, Any]:
    """A store server on the first host, a member's monitor on the second (started)."""
    cluster = make(2)
    store_host, member_host = cluster.hosts
    server = store_host.popen(
        [sys.executable, "-c", SERVER, store_host.addr], stdout=subprocess.PIPE, text=True
    )
    port = int(server.stdout.readline())
    member = member_host.popen(
        [sys.executable, "-c", MEMBER, store_host.name, str(port), str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert member.stdout.readline().strip() == "ready", member.stderr.read()
    return cluster, server, member


def changes(member: subprocess.Popen[str]) -> tuple[list[dict[str, Any]], str]:
    out, err = member.communicate(timeout=60)
    return [json.loads(line) for line in out.splitlines() if line.strip()], err


@pytest.mark.timeout(90)
def test_a_paused_store_whose_host_answers_never_fences(cluster_factory: Callable) -> None:
    # The store's process stops for four timeouts (SIGSTOP: what a host starved of CPU
    # looks like from outside); its kernel still acknowledges the member's packets, so
    # the member waits for it instead of stopping its workers.
    _, server, member = two_hosts(cluster_factory, seconds=8.0)
    time.sleep(1.0)
    server.send_signal(signal.SIGSTOP)
    time.sleep(4 * TIMEOUT)
    server.send_signal(signal.SIGCONT)
    fenced, err = changes(member)
    assert fenced == [], (fenced, err)
    assert "overloaded or paused, not unreachable" in err, err


@pytest.mark.timeout(90)
def test_a_store_cut_off_fences_within_the_timeout(cluster_factory: Callable) -> None:
    cluster, _, member = two_hosts(cluster_factory, seconds=6.0)
    time.sleep(1.0)
    cut = time.time()
    cluster.cut(cluster.hosts[0])
    fenced, err = changes(member)
    assert fenced, f"never fenced\n{err}"
    took = fenced[0]["t"] - cut
    assert TIMEOUT <= took <= TIMEOUT + INTERVAL + 1.5, took  # timeout, one tick, slack
    assert f"cannot reach the rendezvous store at {WHERE}" in fenced[0]["fenced"]
    assert "heartbeat_timeout=1s" in fenced[0]["fenced"]


def count_requests(monkeypatch: pytest.MonkeyPatch) -> dict[int, Counter[str]]:
    """Requests by kind, per TCPStore server of this process, from now on."""
    from elastic.core.tcpstore import server as server_module

    counts: dict[int, Counter[str]] = {}
    handle = server_module.TCPStoreServer._handle

    def counted(self: Any, conn: Any, req: Any) -> None:
        counts.setdefault(id(self), Counter())[req.query.name] += 1
        handle(self, conn, req)

    monkeypatch.setattr(server_module.TCPStoreServer, "_handle", counted)
    return counts


@pytest.fixture
def c10d_job() -> Iterator[Callable[..., list[Any]]]:
    """``make(run_id, n, fingerprint=None)``: n fresh c10d handlers of one job
    (``min = max = n``), the first hosting its store; all shut down after the test, the
    store's host last."""
    from elastic.core.interfaces.rendezvous import RendezvousParameters
    from elastic.plugins.rdzv_c10d import create_handler
    from elastic.testing.ports import free_port

    made: list[Any] = []

    def make(run_id: str, n: int, fingerprint: dict[str, str] | None = None) -> list[Any]:
        params = RendezvousParameters(
            "c10d", f"{HOST}:{free_port()}", run_id, n, n, fingerprint=fingerprint or {}
        )
        for _ in range(n):
            made.append(create_handler(params))
        return made[-n:]

    yield make
    for handler in sorted(made, key=lambda h: h.is_hosting):
        handler.shutdown()


@pytest.mark.timeout(120)
def test_a_fresh_node_sends_one_keep_alive_to_form_a_round(
    monkeypatch: pytest.MonkeyPatch, c10d_job: Callable[..., list[Any]]
) -> None:
    """Four fresh c10d handlers form a round: one slot, one join record and (but for the
    coordinator) one WAIT_GET each, the coordinator's roster and its one keep-alive (it is
    watched while it coordinates). A member sends none on the way, nor at the round's
    instant: the request that brought the outcome counts as its last keep-alive, so its
    first goes out a period (1 s) after that, and none twice."""
    from concurrent.futures import ThreadPoolExecutor

    n = 4
    handlers = c10d_job("round-cost", n)
    counts = count_requests(monkeypatch)  # from here: the round, not the connecting
    started = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    formed = time.monotonic()
    (job,) = [Counter(c) for c in counts.values() if c["ADD"]]
    print("requests forming the round:", dict(job))
    # The join records are compare_sets from absent (a slot may be claimed empty), beside
    # the round key's and the outcome's; the roster is the one SET.
    assert job["ADD"] == n and job["SET"] == 1
    if formed - started < 0.5:  # a member's first keep-alive is not due yet
        assert job["COMPARE_SET"] == n + 2 + 1, job
    # Each member waits for the outcome in one WAIT_GET, which brings it along; the
    # coordinator may wait for a slot whose record is being written.
    assert job["WAIT_GET"] == n - 1 and job["WAIT"] <= 3, job
    # A heartbeat is "<keep-alives sent> <time>"; a member's first is due a period on.
    beats: list[bytes] = []
    while time.monotonic() - formed < 2.5:
        beats = [h.rdzv_store.multi_get([R.hb_key(h.node_id)])[0] for h in handlers]
        if all(beats):
            break
        time.sleep(0.05)
    sent = [int(b.split()[0]) if b else 0 for b in beats]
    members = [k for h, k, info in zip(handlers, sent, infos, strict=True) if info.rank != 0]
    assert members == [1] * (n - 1), beats
    assert sent[[info.rank for info in infos].index(0)] in (1, 2), beats


@pytest.mark.timeout(120)
def test_a_fingerprint_is_checked_with_the_round_state_read(
    monkeypatch: pytest.MonkeyPatch, c10d_job: Callable[..., list[Any]]
) -> None:
    """Every node's fingerprint is checked against the job's, read along with the
    round's state: the first node offers its own (one COMPARE_SET), the others compare
    what that read brought and add no request of their own."""
    from concurrent.futures import ThreadPoolExecutor

    from elastic.core.rendezvous.fingerprint import FIELDS

    n = 4
    handlers = c10d_job("fp-cost", n, {field: "same" for field in FIELDS})
    fingerprint_requests: Counter[str] = Counter()
    counts = count_requests(monkeypatch)
    from elastic.core.tcpstore import server as server_module

    handle = server_module.TCPStoreServer._handle

    def naming_the_fingerprint(self: Any, conn: Any, req: Any) -> None:
        named = any(k.endswith(R.FINGERPRINT.encode()) for k in (req.key, *req.keys))
        if named and len(req.keys) != 1:  # a read of that key alone is the test's poll
            fingerprint_requests[req.query.name] += 1
        handle(self, conn, req)

    monkeypatch.setattr(server_module.TCPStoreServer, "_handle", naming_the_fingerprint)
    with ThreadPoolExecutor(n) as pool:
        first = pool.submit(handlers[0].next_rendezvous)
        # The others come once the first's fingerprint is the job's (else several may
        # find none and each offer theirs, as racing nodes do).
        deadline = time.monotonic() + 30
        while not handlers[0].rdzv_store.multi_get([R.FINGERPRINT])[0]:
            assert time.monotonic() < deadline, "the first node never offered its fingerprint"
            time.sleep(0.01)
        others = [pool.submit(h.next_rendezvous) for h in handlers[1:]]
        infos = [first.result(60), *(f.result(60) for f in others)]
    assert sorted(i.rank for i in infos) == list(range(n))
    (job,) = [Counter(c) for c in counts.values() if c["ADD"]]
    assert job["ADD"] == n  # no node was refused
    assert fingerprint_requests == {"MULTI_GET": n, "COMPARE_SET": 1}, fingerprint_requests


@pytest.mark.timeout(120)
def test_forming_a_round_starts_no_thread(c10d_job: Callable[[str, int], list[Any]]) -> None:
    """A round is only round trips: a handler's threads (monitor, keep-alives) start
    with it and a waiter waits on its own thread (no helper per WAIT); a thousand
    handlers in one process spent seconds of a round starting threads. The one thread a
    round starts at once is each member's presence connection to rank 0, made by its
    monitor thread once the round formed (presence holds from the round's first
    instant), never on the way to the round (one to rank 1, the deputy, only once rank 0
    is gone)."""
    n = 4
    handlers = c10d_job("no-threads", n)
    go = threading.Event()
    infos: list[Any] = []

    def join(handler: Any) -> None:
        go.wait()
        infos.append(handler.next_rendezvous())

    callers = [threading.Thread(target=join, args=(h,)) for h in handlers]
    try:
        for caller in callers:
            caller.start()
        before = set(threading.enumerate())
        go.set()
        for caller in callers:
            caller.join(60)
        assert len(infos) == n
        time.sleep(0.5)  # well before the round's first tick (an interval: 1 s)
        started = set(threading.enumerate()) - before
        names = sorted(t.name for t in started)
        # Every presence connection of the process is served by one thread (started by
        # an earlier test of this process, or now).
        assert set(names) <= {"rdzv-presence-clients"}, names
        connected = [h for h in handlers if h._monitor.liveness.links.client is not None]
        assert len(connected) == n - 1  # every member but rank 0 has its connection
    finally:
        go.set()


@pytest.mark.timeout(120)
def test_a_joiner_learns_its_coordinator_from_the_round_s_state_read(
    monkeypatch: pytest.MonkeyPatch, c10d_job: Callable[[str, int], list[Any]]
) -> None:
    """A node that finds slot 1 of the round taken when it reads the round's state (one
    read: closed, the round, its outcome, slot 1's record) reads no join record to learn
    who coordinates: one request less per joiner."""
    from concurrent.futures import ThreadPoolExecutor

    from elastic.core.rendezvous.round.joining import Joiner

    n = 3
    handlers = c10d_job("first-slot", n)
    read_slots = Joiner.read_slots
    readers: list[Joiner] = []

    def counted(self: Joiner, rnd: int, first: int, last: int) -> Any:
        readers.append(self)
        return read_slots(self, rnd, first, last)

    monkeypatch.setattr(Joiner, "read_slots", counted)
    with ThreadPoolExecutor(n) as pool:
        first = pool.submit(handlers[0].next_rendezvous)  # slot 1: the coordinator
        deadline = time.monotonic() + 30
        while not handlers[0].rdzv_store.multi_get([R.join_key(0, 1)])[0]:
            assert time.monotonic() < deadline, "the first node never joined"
            time.sleep(0.01)
        others = [pool.submit(h.next_rendezvous) for h in handlers[1:]]
        infos = [first.result(60), *(f.result(60) for f in others)]
    assert sorted(i.rank for i in infos) == list(range(n))
    joiners = {id(h.protocol.joiner) for h in handlers[1:]}
    assert not [r for r in readers if id(r) in joiners]
    assert [r for r in readers if r is handlers[0].protocol.joiner]  # the coordinator reads


@pytest.mark.timeout(120)
def test_an_idle_member_costs_the_store_two_requests_a_second(
    monkeypatch: pytest.MonkeyPatch, c10d_job: Callable[[str, int], list[Any]]
) -> None:
    """Three c10d handlers (defaults: a keep-alive and a tick a second) in a formed round,
    each with the agent's job watch running: the store answers each node's keep-alive
    (COMPARE_SET) and one MULTI_GET a second, nothing else (no WAIT, no job-watch read)."""
    from concurrent.futures import ThreadPoolExecutor

    from elastic.core.agent.job_watch import JobWatch

    counts = count_requests(monkeypatch)
    handlers = c10d_job("count", 3)
    watches = []
    try:
        with ThreadPoolExecutor(3) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        watches = [JobWatch(i.store, i.round, 1.0, h) for h, i in zip(handlers, infos, strict=True)]
        time.sleep(2.0)  # every tick has its job keys now
        busiest = max(counts.values(), key=lambda c: sum(c.values()))
        before = Counter(busiest)
        seconds = 6.0
        time.sleep(seconds)
        during = Counter(busiest)
        during.subtract(before)
        per_node_second = {k: v / (3 * seconds) for k, v in during.items() if v}
        print("requests per node per second:", per_node_second)
        assert set(per_node_second) <= {"COMPARE_SET", "MULTI_GET"}, per_node_second
        assert sum(per_node_second.values()) <= 2.2, per_node_second  # one of each, a late tick
    finally:
        for watch in watches:
            watch.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["c10d", "etcd-v3"])
def test_a_store_paused_for_three_seconds_fences_nobody(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Default settings (keep-alive every second, heartbeat_timeout 5 s, lease 4 s): the
    store's process (the c10d store server, the etcd server) stops for 3 s (SIGSTOP, then
    SIGCONT). Nobody is cut off, so nobody fences: on c10d the keep-alive waiting in the
    paused store is waited for; on etcd the lease outlasts the pause."""
    if backend == "c10d":
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, HOST], stdout=subprocess.PIPE, text=True
        )
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        store: Any = PrefixStore(Connection(HOST, port, timeout=30.0), "job/")
        lease_store: Any = PrefixStore(Connection(HOST, port, timeout=10.0), "job/")
    else:
        from elastic.plugins.rdzv_etcd_v3.client import V3Config
        from elastic.plugins.rdzv_etcd_v3.store import EtcdV3Store

        cluster = request.getfixturevalue("etcd_v3_server")
        proc = cluster.members[0].proc
        config = V3Config(cluster.endpoint, read_timeout=5 / 3)
        store = EtcdV3Store(config, "/job/", lease_ttl=10)
        lease_store = EtcdV3Store(config, "/job/", lease_ttl=10)
    monitor = Monitor(store, "b", interval=1.0, timeout=5.0, lease_store=lease_store)
    try:
        store.heartbeat("rdzv/" + R.hb_key("a"), "1 0")
        monitor.set_round(R.Assignment(round=0, state="formed", size=2, first="a"), rank=1)
        monitor.start()
        time.sleep(1.5)
        proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(3.0)
        finally:
            proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            assert monitor.fenced(WHERE) is None, monitor.fenced(WHERE)
            time.sleep(0.05)
    finally:
        monitor.stop(wait=False)
        store.close()
        lease_store.close()
        if backend == "c10d":
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_a_first_round_s_outcome_does_not_grow_with_the_round(
    c10d_job: Callable[[str, int], list[Any]],
) -> None:
    """Every node reads the outcome: a first round's is the same size for 2 nodes as for
    20 (rank 0, the world size, one run of ranks by slot, at most ``SUCCESSORS``
    standbys), while the roster, which only rank 0, the next coordinator and ``status``
    read, names every member by rank."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    sizes = {}
    for n in (2, 20):
        handlers = c10d_job(f"outcome-{n}", n)
        with ThreadPoolExecutor(n) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        (raw,) = handlers[0].rdzv_store.multi_get([R.assignment_key(0)])
        outcome = json.loads(raw)
        # Every member but the store's host keeps a standby; the outcome names 16 at most.
        assert len(outcome.pop("successors")) == min(n - 1, R.SUCCESSORS)
        sizes[n] = len(json.dumps(outcome))
        roster = handlers[0].protocol.roster(0)
        assert roster.members == [i.node_id for i in sorted(infos, key=lambda i: i.rank)]
        assert len(roster.standbys) == len(roster.hosts) == n
        assert {i.world_size for i in infos} == {n}
    # Digits of counts and ports may differ; a member's id alone is over 20 bytes.
    assert abs(sizes[20] - sizes[2]) < 20, sizes


def test_ranks_by_join_slot_survive_the_outcome_s_round_trip() -> None:
    """``Assignment.ranks``: runs of [first slot, rank, count] from which a node finds its
    rank by its join slot; slots no member holds (a foreign record, a clash) have none."""
    import random

    rng = random.Random(7)
    for n in (1, 2, 5, 64):
        slots = rng.sample(range(1, 3 * n + 1), n)  # by rank; gaps between them
        for order in (sorted(slots), slots):
            asg = R.Assignment(0, "formed", size=n, ranks=R.rank_runs(order))
            asg = R.Assignment.from_json(asg.to_json().encode(), "k", 0)
            assert [asg.rank_of(slot) for slot in order] == list(range(n))
            assert all(asg.rank_of(s) is None for s in range(3 * n + 2) if s not in order)
    assert R.rank_runs(list(range(1, 1025))) == [[1, 0, 1024]]  # a first round: one run
    for bad in ('[["1", 0, 2]]', "[[1, 0]]", '"x"'):
        raw = f'{{"round": 0, "state": "formed", "size": 2, "ranks": {bad}}}'.encode()
        if bad == "[[1, 0]]":  # too short: no rank from it, not an error
            assert R.Assignment.from_json(raw, "k", 0).rank_of(1) is None
            continue
        with pytest.raises(RendezvousStateError):
            R.Assignment.from_json(raw, "k", 0)


def test_a_stale_value_s_verdict_read_is_due_timeout_after_its_first_receipt() -> None:
    """``LivenessTracker.due``: reads on a 1 s grid, each answered 10 ms after it was sent;
    the value first received at 0.01 may be judged by a read sent at 5.01, which the grid
    only sends at 6.0. Once that read was sent, the value is left to the ticks."""
    from elastic.core.rendezvous.round.liveness import LivenessTracker

    tracker = LivenessTracker(timeout=5.0, interval=1.0)
    assert tracker.due() is None
    for t in range(5):  # reads sent at 0..4: the value first received at 0.01, then kept
        assert tracker.update({"a": b"7"}, asked=float(t), answered=t + 0.01) == ([], [])
        assert tracker.due() == (5.01 if t >= tracker.min_reads - 1 else None), t
    assert tracker.update({"a": b"7"}, asked=5.0, answered=5.01) == ([], [])  # too soon
    assert tracker.due() == 5.01
    assert tracker.update({"a": b"7"}, asked=5.01, answered=5.02) == (["a"], [])
    assert tracker.due() is None  # read once at its due: no second extra read
    tracker.update({"a": b"8"}, asked=5.5, answered=5.51)  # a new value: a new clock
    assert tracker.due() is None  # too few reads of it yet
    for t in (6.5, 7.5, 8.5, 9.5):
        tracker.update({"a": b"8"}, asked=t, answered=t + 0.01)
    assert tracker.due() == 10.51


@pytest.mark.timeout(60)
def test_a_silent_member_is_lost_timeout_after_its_beat_was_read_not_a_tick_later(
    server: TCPStoreServer,
) -> None:
    """Rank 1 watches rank 0 ("a"), whose one beat it first reads on the round's first
    tick (an interval after it formed). The verdict comes from a read sent
    ``heartbeat_timeout`` after that, not from the first tick past it (an interval
    later when the grid's read is sent a moment too soon, as it mostly is)."""
    interval, timeout = 1.0, 3.0
    start = time.monotonic()
    monitor, conn = member_monitor(server.port, interval=interval, timeout=timeout)
    probe_conn = Connection(HOST, server.port, timeout=30.0)
    probe = PrefixStore(probe_conn, "job/rdzv/")
    try:
        lost_at = None
        while time.monotonic() - start < 15:
            if probe.check([R.lost_key(0)]):
                lost_at = time.monotonic() - start
                break
            time.sleep(0.02)
        assert lost_at is not None, "rank 0 never counted lost"
        assert json.loads(probe.get(R.lost_key(0))) == ["a"]
        # First read at ~interval; the grid's deciding read would be at interval +
        # timeout + interval (4 + 1 s).
        assert interval + timeout <= lost_at <= interval + timeout + 0.5, lost_at
    finally:
        monitor.stop()
        conn.close()
        probe_conn.close()


class _HeldBeats:
    """A real store view whose heartbeats wait for ``release`` before they go out (a
    keep-alive on its way while its node shuts down)."""

    def __init__(self, inner: PrefixStore) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.started = threading.Event()

    def heartbeat(self, key: str, value: bytes | str) -> None:
        self.started.set()
        self.release.wait(10)
        self.inner.heartbeat(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.timeout(60)
def test_a_keep_alive_on_its_way_lands_before_join_returns(server: TCPStoreServer) -> None:
    """``Lease.join`` (before a node writes "done") waits for a keep-alive on its way,
    whichever thread sent it, and no longer than that: with none on its way it returns
    at once."""
    from elastic.core.rendezvous.round.lease import Lease

    conn = Connection(HOST, server.port, timeout=10.0)
    store = _HeldBeats(PrefixStore(conn, "job/"))
    lease = Lease(store, "hb", interval=1.0, timeout=5.0)  # type: ignore[arg-type]
    try:
        sender = threading.Thread(target=lease.renew, daemon=True)
        sender.start()
        assert store.started.wait(5)
        lease.stop()
        threading.Timer(0.5, store.release.set).start()
        started = time.monotonic()
        lease.join(5.0)
        waited = time.monotonic() - started
        assert 0.4 < waited < 4, waited
        beat = store.inner.multi_get(["hb"])[0]
        assert beat.startswith(b"1 "), beat  # it landed before join returned
        started = time.monotonic()
        lease.join(5.0)  # nothing on its way now
        assert time.monotonic() - started < 0.2
    finally:
        store.release.set()
        lease.stop()
        conn.close()
