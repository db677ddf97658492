"""With a job token, a client without it changes nothing that matters: every forged or
replayed record is ignored (against torch's own TCPStore server as the c10d endpoint,
which anyone can write to), and our own store server admits no such client at all."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from elastic.core.agent.job_watch import JobWatch
from elastic.core.agent.restarts import claim_restart, job_failed, restarts_used
from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.job_keys import BUDGET_KEY, FAILED_KEY
from elastic.core.interfaces.rendezvous import (
    RendezvousAuthError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreGoneError,
)
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.signing import SignedStore
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.core.watchdog.job_channel import PROGRESS_KEY, STALL_MARK, JobStallChannel
from elastic.harness.c10d_handlers import (
    FAST,
    Make,
    c10d_handlers,
    rendezvous_all,
    write_token_file,
)
from elastic.plugins.rdzv_c10d import create_handler
from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler
from elastic.testing.conformance import by_rank, round_members
from elastic.testing.waits import wait_until

JOB = "elastic/job/"  # where the c10d backend keeps job "job"'s keys
TOKEN = b"the-job-token"


def torch_client(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10), use_libuv=True)


@pytest.fixture
def torch_served(port: int) -> Iterator[Any]:
    """torch's own TCPStore server on the endpoint: the agents are all its clients."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), use_libuv=True)
    yield server
    del server


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    return write_token_file(tmp_path / "token", TOKEN + b"\n")


@pytest.fixture
def make(port: int, token_file: str) -> Iterator[Make]:
    """``make(n=2, **conf)``: a node of an ``n``-node job with the token."""
    with c10d_handlers(port, config={**FAST, "token_file": token_file}) as make_handler:
        yield lambda n=2, **conf: make_handler(n, **conf)


@pytest.fixture
def job(torch_served: Any, make: Make) -> tuple[list[C10dRendezvousHandler], list[RendezvousInfo]]:
    """Two nodes with the token in round 0, on a store anyone can write to (torch's:
    ``is_host=false`` says the store is external, so one that cannot prove the token)."""
    handlers = [make(is_host="false"), make(is_host="false")]
    infos = rendezvous_all(handlers, timeout=30)
    assert not any(h.is_hosting for h in handlers)  # torch serves it
    return handlers, infos


def bump_events(torch_served: Any) -> None:
    torch_served.add(JOB + "rdzv/events", 1)


def quiet_for(seconds: float, still: Callable[[], bool]) -> bool:
    """Whether ``still()`` held the whole time (a few heartbeat ticks)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not still():
            return False
        time.sleep(0.05)
    return True


def test_a_forged_close_is_ignored(job: Any, torch_served: Any, caplog: Any) -> None:
    handlers, _ = job
    torch_served.set(JOB + "rdzv/closed", json.dumps({"at": time.time(), "by": "evil"}))
    bump_events(torch_served)
    assert quiet_for(1.5, lambda: not any(h.is_closed() for h in handlers))
    assert "ignoring elastic/job/rdzv/closed: it is not signed" in caplog.text
    # Once per key and node (both nodes are in this process).
    assert caplog.text.count("ignoring elastic/job/rdzv/closed") == len(handlers)


def test_a_forged_lost_list_is_ignored(job: Any, torch_served: Any) -> None:
    handlers, infos = job
    torch_served.set(JOB + "rdzv/" + R.lost_key(0), json.dumps(by_rank(infos)))
    bump_events(torch_served)
    # Nobody is lost, nobody fenced (lost_nodes raises for a node declared lost).
    assert quiet_for(1.5, lambda: all(h.lost_nodes() == [] for h in handlers))
    assert not handlers[0].membership_changed()


def test_garbage_events_stop_no_monitor(job: Any, torch_served: Any) -> None:
    handlers, infos = job
    torch_served.set(JOB + "rdzv/events", "x")
    assert quiet_for(1.0, lambda: all(h.lost_nodes() == [] for h in handlers))
    # Still watching: a real departure is seen (its note repairs the counter).
    handlers[1].leave()
    assert wait_until(lambda: handlers[0].lost_nodes() == [infos[1].node_id], 10)


def test_a_forged_abandoned_round_is_ignored(job: Any, torch_served: Any) -> None:
    handlers, _ = job
    forged = R.Assignment(round=1, state="abandoned").to_json()
    torch_served.set(JOB + "rdzv/" + R.assignment_key(1), forged)
    infos = rendezvous_all(handlers, timeout=30)
    assert {i.round for i in infos} == {1}  # not pushed on to round 2


def test_a_replayed_assignment_is_ignored(job: Any, torch_served: Any) -> None:
    handlers, first = job
    # The round-0 assignment, signed with the real token, copied to round 1.
    signed = torch_served.get(JOB + "rdzv/" + R.assignment_key(0))
    torch_served.set(JOB + "rdzv/" + R.assignment_key(1), signed)
    infos = rendezvous_all(handlers, timeout=30)
    assert {i.round for i in infos} == {1}
    assert infos[0].master_port != first[0].master_port or infos[0].round != first[0].round
    asg = handlers[0].protocol.read_assignment(1)
    assert asg is not None and asg.round == 1 and asg.state == "formed"


def test_a_forged_failed_flag_is_ignored(job: Any, torch_served: Any) -> None:
    _, infos = job
    torch_served.set(JOB + FAILED_KEY, "1")
    watch = JobWatch(infos[0].store, 0, interval=0.1)
    try:
        assert quiet_for(0.6, lambda: not watch.failed)
    finally:
        watch.stop()
    assert not job_failed(infos[0].store)


def test_a_forged_restart_budget_is_ignored(job: Any, torch_served: Any) -> None:
    _, infos = job
    torch_served.set(JOB + BUDGET_KEY, json.dumps({"used": 99, "rounds": [0]}))
    assert restarts_used(infos[0].store) == 0
    assert claim_restart(infos[1].store, 0, "b") == 1  # the forged record is replaced
    assert restarts_used(infos[0].store) == 1


def test_a_forged_stall_mark_dumps_nothing(job: Any, torch_served: Any) -> None:
    _, infos = job
    channel = JobStallChannel(infos[0].store, 0, 2, 2.0, time.monotonic)
    try:
        torch_served.add(JOB + PROGRESS_KEY.format(0), STALL_MARK)
        assert quiet_for(1.0, lambda: not channel.peer_stall.is_set())
    finally:
        channel.stop()


def test_a_forged_join_cannot_take_rank_0(torch_served: Any, make: Make) -> None:
    slot = torch_served.add(JOB + "rdzv/" + R.count_key(0), 1)
    forged = {"id": "evil:1:x", "host": "evil", "addr": "10.9.9.9", "port": 1, "round": 0}
    torch_served.set(JOB + "rdzv/" + R.join_key(0, slot), json.dumps({**forged, "rank_hint": 0}))
    handlers = [make(is_host="false"), make(is_host="false")]
    infos = rendezvous_all(handlers, timeout=30)
    assert "evil:1:x" not in round_members(handlers[0], infos[0])
    assert {i.master_addr for i in infos} == {"127.0.0.1"}


# --- our own server: no token, no access ------------------------------------------------


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer("127.0.0.1", 0, token=TOKEN) as srv:
        yield srv


def test_a_client_without_the_token_gets_nothing(server: TCPStoreServer) -> None:
    with pytest.raises(RendezvousAuthError, match="requires the job's token"):
        TCPStoreClient("127.0.0.1", server.port)
    with pytest.raises(RendezvousAuthError, match="holds another token than this node"):
        TCPStoreClient("127.0.0.1", server.port, token=b"a-guess")
    # torch's client skips the handshake: its first request closes the connection.
    store = torch_client(server.port)
    store.set("written", "by-a-stranger")  # no answer expected: the server drops it
    with pytest.raises(Exception, match="(?i)closed|recv|connection|broken|reset"):
        store.add("counted", 1)
    with TCPStoreClient("127.0.0.1", server.port, token=TOKEN) as client:
        assert client.num_keys() == 0  # nothing the strangers sent was applied
        client.set("k", "v")
        assert client.get("k") == b"v"


def test_our_client_with_a_token_works_with_torchs_server(torch_served: Any, port: int) -> None:
    """Only where the user said the store is external: torch's server closes the
    connection at the token handshake, as a busy store or an impostor might."""
    torch_served.set("from-torch", "1")
    for _ in range(2):  # the second connection skips the handshake torch refused
        with TCPStoreClient("127.0.0.1", port, token=TOKEN, torch_ok=True) as client:
            assert client.get("from-torch") == b"1"


def test_a_store_that_cannot_prove_the_token_is_not_taken_unasked(
    torch_served: Any, port: int
) -> None:
    """Without ``torch_ok`` a store closing at the handshake is busy, tried again until
    the connect timeout, then one line naming the way to accept torch's server; it is
    never marked torch-served for the process (the next client still asks)."""
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="is_host=false") as caught:
            TCPStoreClient("127.0.0.1", port, timeout=1.0, token=TOKEN)
        assert not isinstance(caught.value, RendezvousStoreGoneError)
        assert 0.5 < time.monotonic() - started < 5  # tried again, then gave up


def test_status_authenticates_with_the_token(port: int, make: Make, token_file: str) -> None:
    handlers = [make(), make()]
    rendezvous_all(handlers, timeout=30)
    assert any(h.is_hosting for h in handlers)  # our server, with the token
    for conf, ok in (({"token_file": token_file}, True), ({}, False)):
        params = RendezvousParameters(
            "c10d", f"127.0.0.1:{port}", "job", 2, 2, config=conf, read_only=True
        )
        if ok:
            reader = create_handler(params)
            try:
                assert reader.describe().state == "running"
            finally:
                reader.shutdown()
        else:
            with pytest.raises(RendezvousAuthError, match="requires the job's token"):
                create_handler(params)


# --- the restart budget: claimed and charged in one write -------------------------------


@pytest.fixture
def job_store() -> Iterator[Callable[[], SignedStore]]:
    """Views of one job on our own server, as the agent gets them (signed, with a token)."""
    with TCPStoreServer("127.0.0.1", 0, token=TOKEN) as srv:
        conns: list[Connection] = []

        def view() -> SignedStore:
            conn = Connection("127.0.0.1", srv.port, 10.0, token=TOKEN)
            conns.append(conn)
            return SignedStore(PrefixStore(conn, JOB), TOKEN, "job")

        yield view
        for conn in conns:
            conn.close()


def test_two_claimers_of_one_round_charge_once(job_store: Callable[[], SignedStore]) -> None:
    stores = [job_store() for _ in range(8)]
    start = threading.Barrier(len(stores))

    def claim(store: SignedStore) -> int:
        start.wait()
        return claim_restart(store, 3, "node")

    with ThreadPoolExecutor(len(stores)) as pool:
        seen = list(pool.map(claim, stores))
    assert seen == [1] * len(stores)
    assert restarts_used(stores[0]) == 1


def test_claimers_of_distinct_rounds_charge_once_each(
    job_store: Callable[[], SignedStore],
) -> None:
    stores = [job_store() for _ in range(12)]
    start = threading.Barrier(len(stores))

    def claim(args: tuple[int, SignedStore]) -> tuple[int, int]:
        rnd, store = args
        start.wait()
        return claim_restart(store, rnd, "node"), claim_restart(store, rnd, "again")

    with ThreadPoolExecutor(len(stores)) as pool:
        seen = list(pool.map(claim, enumerate(stores)))
    assert sorted(first for first, _ in seen) == list(range(1, len(stores) + 1))
    assert all(again >= first for first, again in seen)  # a round is charged once
    assert restarts_used(stores[0]) == len(stores)


# --- where the token comes from; saying a store is open ----------------------------------


def params_with(conf: dict[str, str]) -> RendezvousParameters:
    return RendezvousParameters("c10d", "127.0.0.1:1", "job", 1, 1, config=conf)


def test_the_token_from_the_environment(
    tmp_path: Path, token_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic.core.interfaces.rendezvous import RendezvousConfigError
    from elastic.core.rendezvous.round.settings import parse_round_settings

    monkeypatch.setenv("ELASTIC_RDZV_TOKEN_FILE", token_file)
    assert parse_round_settings(params_with({})).token == TOKEN
    other = tmp_path / "other"
    other.write_text("from-the-flag")
    other.chmod(0o600)
    flag = parse_round_settings(params_with({"token_file": str(other)}))
    assert flag.token == b"from-the-flag"  # the explicit flag wins
    monkeypatch.setenv("ELASTIC_RDZV_TOKEN", "inline")
    with pytest.raises(RendezvousConfigError, match="both set: give the job token one way"):
        parse_round_settings(params_with({}))
    monkeypatch.delenv("ELASTIC_RDZV_TOKEN_FILE")
    assert parse_round_settings(params_with({})).token == b"inline"
    monkeypatch.setenv("ELASTIC_RDZV_TOKEN_FILE", str(tmp_path / "missing"))
    monkeypatch.delenv("ELASTIC_RDZV_TOKEN")
    with pytest.raises(RendezvousConfigError, match="ELASTIC_RDZV_TOKEN_FILE=.*missing"):
        parse_round_settings(params_with({}))


def outside_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    from elastic.core.rendezvous import net

    addr = net.route_address("192.0.2.1", 9)  # TEST-NET-1: no packet is sent
    return None if net.is_loopback(addr) else addr


def test_an_open_store_on_the_network_is_said_once(
    capfd: pytest.CaptureFixture[str], token_file: str
) -> None:
    from elastic.testing.ports import free_port

    addr = outside_address()
    if addr is None:
        pytest.skip("this machine has no address but loopback")
    made = []
    for conf in ({}, {"token_file": token_file}):
        params = RendezvousParameters(
            "c10d", f"{addr}:{free_port()}", "job", 1, 1, config={**FAST, **conf}
        )
        made.append(create_handler(params))
        try:
            made[-1].next_rendezvous()
        finally:
            made[-1].shutdown()
    err = capfd.readouterr().err
    assert err.count("is open to anyone on the network") == 1, err  # only without a token
    assert "ELASTIC_RDZV_TOKEN_FILE" in err


def test_garbage_in_counters_fails_nothing(job: Any, torch_served: Any) -> None:
    """Counters cannot be signed; garbage in one (where an add would fail) is replaced."""
    handlers, infos = job
    for key in ("rdzv/events", "rdzv/" + R.count_key(1), "agent/failures/count"):
        torch_served.set(JOB + key, "garbage")
    record = fail.FailureRecord("trainer", 0, 0, "h", 1, 3, time.time())
    fail.publish(infos[0].store, record)
    assert [r.exit_code for r in fail.collect(infos[1].store)] == [3]
    assert {i.round for i in rendezvous_all(handlers, timeout=30)} == {1}


def test_a_forged_or_replayed_round_number_is_undone(job: Any, torch_served: Any) -> None:
    handlers, _ = job
    assert {i.round for i in rendezvous_all(handlers, timeout=30)} == {1}
    signed_round_1 = torch_served.get(JOB + "rdzv/round")
    assert {i.round for i in rendezvous_all(handlers, timeout=30)} == {2}
    for forged in (b"0", signed_round_1):  # garbage, and an older signed value
        torch_served.set(JOB + "rdzv/round", forged)
        rounds = {i.round for i in rendezvous_all(handlers, timeout=30)}
        assert rounds == {max(rounds)} and max(rounds) >= 3, (forged, rounds)


def test_a_forged_failure_count_costs_a_bounded_read(job: Any, torch_served: Any) -> None:
    _, infos = job
    fail.publish(infos[0].store, fail.FailureRecord("trainer", 0, 0, "h", 1, 3, time.time()))
    torch_served.set(JOB + fail.COUNT_KEY, str(10**12))
    started = time.monotonic()
    assert [r.exit_code for r in fail.collect(infos[1].store)] == [3]
    assert time.monotonic() - started < 60  # generous: 65536 keys, a few requests


def test_a_node_without_the_token_is_told_so(job: Any, port: int) -> None:
    """On a store that cannot check tokens, a node without one meets signed records."""
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "job", 2, 2, config=FAST)
    stranger = create_handler(params)
    try:
        with pytest.raises(RendezvousAuthError, match="signed with a job token"):
            stranger.next_rendezvous()
    finally:
        stranger.shutdown()
