"""The c10d rendezvous backend against a real loopback TCPStore, handlers as threads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from elastic.core.agent.regroup import left_out_a_peer
from elastic.core.agent.restarts import claim_restart
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousReusedIdError,
    RendezvousStateError,
)
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.presence import CONNECT_WAIT
from elastic.harness.c10d_handlers import FAST, Make, c10d_handlers, rendezvous_all
from elastic.plugins.rdzv_c10d import create_handler
from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler
from elastic.plugins.rdzv_c10d.store import parse_endpoint
from elastic.testing.conformance import by_rank, round_members
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until


@pytest.fixture
def make(port: int) -> Iterator[Make]:
    """Creates handlers on this test's port; shuts them all down, the host last."""
    with c10d_handlers(port) as factory:
        yield factory


def check_round(infos: list[RendezvousInfo], size: int) -> None:
    assert sorted(i.rank for i in infos) == list(range(size))
    assert {i.world_size for i in infos} == {size}
    assert len({(i.master_addr, i.master_port, i.round) for i in infos}) == 1
    assert len({i.node_id for i in infos}) == size
    assert infos[0].master_addr == "127.0.0.1" and infos[0].master_port > 0


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = "import sys, elastic.plugins.rdzv_c10d; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unknown_conf_key_lists_accepted_keys(port: int) -> None:
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "job", 1, 1, config={"timeout": "5"})
    with pytest.raises(RendezvousConfigError, match="timeout.*accepted:.*last_call_timeout"):
        create_handler(params)


def test_bad_conf_values_are_errors(port: int) -> None:
    for conf in (
        {"heartbeat_interval": "2", "heartbeat_timeout": "3"},
        {"is_host": "maybe"},
        {"store_type": "file"},
        {"join_timeout": "-1"},
    ):
        params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "j", 1, 1, config=conf)
        with pytest.raises(RendezvousConfigError):
            create_handler(params)


def test_parse_endpoint() -> None:
    assert parse_endpoint("node1") == ("node1", 29400)
    assert parse_endpoint("node1:123") == ("node1", 123)
    assert parse_endpoint("[::1]:5") == ("::1", 5)
    with pytest.raises(RendezvousConfigError):
        parse_endpoint("h:notaport")


def test_node_ids_made_in_one_process_are_unique() -> None:
    # A round counts members by id: two handlers of one process (host and pid equal)
    # sharing one stalled a 1024-node rendezvous until join_timeout in ~3% of runs.
    ids = [R.new_node_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert ids[0].startswith(f"{socket.gethostname()}:{os.getpid()}:")


def test_two_nodes_sharing_an_id_are_named_in_a_warning(
    make: Make, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = make(3)
    monkeypatch.setattr(R, "new_node_id", lambda: "clash")
    b, c = make(3), make(3)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in (a, b, c)]
        deadline = time.monotonic() + 10
        while "share a node id" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "round 0: 1 join records share a node id" in caplog.text, caplog.text
        assert "(ids: ['clash'])" in caplog.text
        for h in (a, b, c):
            h.set_closed()
        for f in futures:
            with pytest.raises(RendezvousClosedError):
                f.result(timeout=30)


def test_a_node_waiting_for_its_round_can_close_it_from_another_thread(make: Make) -> None:
    # The agent closes the rendezvous (a finished job, a signal) while another thread of
    # it waits for the coordinator; that wait's connection must not hold the close up.
    coordinator, waiter = make(3), make(3)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(coordinator.next_rendezvous)
        assert wait_until(lambda: coordinator.protocol.store.check([R.join_key(0, 1)]), 10)
        second = pool.submit(waiter.next_rendezvous)
        assert wait_until(lambda: waiter.protocol.store.check([R.join_key(0, 2)]), 10)
        time.sleep(0.3)  # the waiter is parked in its WAIT
        started = time.monotonic()
        waiter.set_closed()
        assert time.monotonic() - started < 3
        for f in (first, second):
            with pytest.raises(RendezvousClosedError):
                f.result(timeout=10)


@pytest.mark.parametrize("nodes", [2, 4])
def test_fixed_size(make: Make, nodes: int) -> None:
    handlers = [make(nodes) for _ in range(nodes)]
    assert [h.is_hosting for h in handlers].count(True) == 1
    infos = rendezvous_all(handlers)
    check_round(infos, nodes)
    assert infos[0].round == 0
    # The job store is shared and namespaced: what one agent writes, all read.
    infos[0].store.add("agent/restarts", 1)
    assert int(infos[-1].store.get("agent/restarts")) == 1


def test_hosted_store_listens_on_the_endpoint_address_only(make: Make, port: int) -> None:
    make(1)
    with socket.socket() as sock:  # 127.0.0.2 is this machine too, but not the endpoint
        assert sock.connect_ex(("127.0.0.2", port)) != 0
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) == 0


def test_min_max_last_call_then_scale_up_with_stable_ranks(make: Make) -> None:
    conf = {"last_call_timeout": "1"}
    first = [make(2, 4, **conf) for _ in range(3)]
    started = time.monotonic()
    infos = rendezvous_all(first)
    assert time.monotonic() - started >= 0.9  # the last call waited for more nodes
    check_round(infos, 3)
    ranks = {h.node_id: i.rank for h, i in zip(first, infos, strict=True)}

    late = make(2, 4, **conf)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(late.next_rendezvous)
        assert wait_until(lambda: all(h.num_nodes_waiting() > 0 for h in first), timeout=10)
        again = rendezvous_all(first)  # what each agent does on num_nodes_waiting() > 0
        newest = pending.result(timeout=10)
    check_round([*again, newest], 4)
    assert newest.round == infos[0].round + 1
    assert {h.node_id: i.rank for h, i in zip(first, again, strict=True)} == ranks
    assert newest.rank == 3


def test_a_live_member_slow_to_see_a_scale_up_is_waited_for_past_a_short_last_call(
    make: Make,
) -> None:
    """A member learns of a waiting node on its next tick, then its agent looks: with a
    last call (0.3 s) shorter than that, the round still waits for a live member of the
    last round (until it comes, or its heartbeat is found stale), rather than form
    without it and re-form a second later."""
    conf = {"last_call_timeout": "0.3", "heartbeat_interval": "1", "heartbeat_timeout": "3"}
    a, b = make(2, 3, **conf), make(2, 3, **conf)
    check_round(rendezvous_all([a, b]), 2)
    late = make(2, 3, **conf)
    with ThreadPoolExecutor(3) as pool:
        pending = pool.submit(late.next_rendezvous)
        assert wait_until(lambda: a.num_nodes_waiting() > 0, timeout=10)
        first = pool.submit(a.next_rendezvous)
        time.sleep(1.2)  # b's tick and its agent's look come later
        second = pool.submit(b.next_rendezvous)
        infos = [f.result(timeout=20) for f in (first, second, pending)]
    check_round(infos, 3)


@pytest.mark.parametrize("joiners", [1, 2], ids=["last-call", "max-nodes"])
def test_a_round_never_forms_while_a_missing_member_may_hold_its_lease(
    make: Make, joiners: int
) -> None:
    """A member of the last round stops beating (cut off from the store, say) and does
    not come back. A scale-up round forms without it only once the coordinator's own
    reads found its heartbeat stale, so after its lease ended (heartbeat_timeout - 1 s
    after its last acknowledged keep-alive; its workers stop then), however short the
    last call, and when max_nodes (3) joined without it too: formed sooner, the new
    round's workers would start beside its old ones."""
    conf = {"last_call_timeout": "0.3", "heartbeat_interval": "0.5", "heartbeat_timeout": "3"}
    a, b = make(1, 3, **conf), make(1, 3, **conf)
    check_round(rendezvous_all([a, b]), 2)
    quiet = b._monitor
    assert quiet is not None and quiet.lease.on_acked is not None
    said, acked = quiet.lease.on_acked, []

    def last_one(value: bytes) -> None:  # on b's keep-alive thread: no more after this
        said(value)
        acked.append(time.monotonic())
        quiet.lease.suspend()

    quiet.lease.on_acked = last_one
    assert wait_until(lambda: bool(acked), 10)
    late = [make(1, 3, **conf) for _ in range(joiners)]
    with ThreadPoolExecutor(1 + joiners) as pool:
        pending = [pool.submit(h.next_rendezvous) for h in late]
        assert wait_until(lambda: a.num_nodes_waiting() >= joiners, timeout=10)
        first = pool.submit(a.next_rendezvous)
        infos = [f.result(timeout=30) for f in (first, *pending)]
        formed = time.monotonic() - acked[0]
    check_round(infos, 1 + joiners)
    assert b.node_id not in {i.node_id for i in infos}
    lease = 3.0 - 1.0
    assert lease + 0.5 <= formed < 3.0 + 0.5 + 2.0, formed  # after its lease; not long after


def test_full_job_keeps_late_node_on_standby(make: Make) -> None:
    handlers = [make(1, 2, last_call_timeout="5") for _ in range(2)]  # max: no wait
    check_round(rendezvous_all(handlers), 2)
    extra = make(1, 2, last_call_timeout="5")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(extra.next_rendezvous)
        time.sleep(1)
        assert [h.num_nodes_waiting() for h in handlers] == [0, 0]  # no restart for it
        assert not pending.done()
        extra.set_closed()
        with pytest.raises(RendezvousClosedError):
            pending.result(timeout=10)


def test_closed_rendezvous_rejects_late_joiners(make: Make) -> None:
    handlers = [make(2) for _ in range(2)]
    rendezvous_all(handlers)
    late = make(2)  # started before the job closed: one of its nodes, late
    time.sleep(0.05)  # the closing comes after it started, on any clock resolution
    handlers[0].set_closed()
    assert wait_until(lambda: all(h.is_closed() for h in handlers), timeout=5)
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()
    # Started after the job closed: a new job given the finished one's id.
    with pytest.raises(RendezvousReusedIdError, match="already finished.*new --rdzv-id"):
        make(2).next_rendezvous()


def test_closing_wakes_nodes_waiting_for_a_round(make: Make) -> None:
    waiting = make(3)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(waiting.next_rendezvous)
        time.sleep(0.5)
        make(3).set_closed()
        with pytest.raises(RendezvousClosedError):
            pending.result(timeout=10)


def test_two_run_ids_on_one_endpoint_never_merge(make: Make) -> None:
    a = [make(2, run_id="job-a") for _ in range(2)]
    b = [make(2, run_id="job-b") for _ in range(2)]
    infos = rendezvous_all([a[0], b[0], a[1], b[1]])
    check_round([infos[0], infos[2]], 2)
    check_round([infos[1], infos[3]], 2)
    assert not set(round_members(a[0], infos[0])) & set(round_members(b[0], infos[1]))


def raw_client(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10), use_libuv=True)


def forge_join(port: int, run_id: str, rnd: int, record: dict[str, Any]) -> None:
    store, prefix = raw_client(port), f"elastic/{run_id}/rdzv/"
    slot = store.add(prefix + R.count_key(rnd), 1)
    store.set(prefix + R.join_key(rnd, slot), json.dumps(record))
    store.set(prefix + R.hb_key(record["id"]), "1 0")  # a heartbeat that never changes


def test_token_from_environment(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_RDZV_TOKEN", "abc")
    handlers = [make(2) for _ in range(2)]
    check_round(rendezvous_all(handlers), 2)
    assert handlers[0].settings.token == b"abc"


def test_dead_coordinator_abandons_the_round(make: Make, port: int) -> None:
    first = make(2)  # hosts; joins after the forged coordinator below
    forge_join(
        port,
        "job",
        0,
        {"id": "ghost:1:x", "host": "ghost", "addr": "127.0.0.1", "port": 1, "round": 0},
    )
    second = make(2)
    started = time.monotonic()
    infos = rendezvous_all([first, second])
    check_round(infos, 2)
    assert infos[0].round == 1 and "ghost:1:x" not in round_members(first, infos[0])
    assert time.monotonic() - started < 10


def test_lost_node_detected_and_survivors_reform(make: Make) -> None:
    handlers = [make(2, 3, last_call_timeout="5") for _ in range(3)]
    infos = rendezvous_all(handlers)  # max reached at once: no last call
    check_round(infos, 3)
    victim = next(h for h, i in zip(handlers, infos, strict=True) if i.rank == 1)
    survivors = [h for h in handlers if h is not victim]
    victim._suspend_heartbeats()
    started = time.monotonic()
    assert wait_until(lambda: all(h.lost_nodes() == [victim.node_id] for h in survivors), 10)
    detected = time.monotonic() - started
    assert 1.0 <= detected < 4.5, detected  # heartbeat_timeout=1.5 plus a tick or two
    again = rendezvous_all(survivors)
    check_round(again, 2)
    assert time.monotonic() - started < 8  # no last call: every survivor was expected
    assert victim.node_id not in round_members(survivors[0], again[0])


def test_rank_zero_loss_is_seen_by_everyone(make: Make) -> None:
    handlers = [make(3) for _ in range(3)]
    infos = rendezvous_all(handlers)
    rank0 = next(h for h, i in zip(handlers, infos, strict=True) if i.rank == 0)
    rank0._suspend_heartbeats()
    others = [h for h in handlers if h is not rank0]
    assert wait_until(lambda: all(h.lost_nodes() == [rank0.node_id] for h in others), 10)


def test_shutdown_after_the_job_closed_is_not_a_lost_node(make: Make) -> None:
    handlers = [make(2) for _ in range(2)]
    rendezvous_all(handlers)
    client = next(h for h in handlers if not h.is_hosting)
    host = next(h for h in handlers if h.is_hosting)
    client.set_closed()
    client.shutdown()
    time.sleep(2.5)
    assert host.lost_nodes() == []


@pytest.mark.parametrize("closer", ["watcher", "silent"])
def test_a_member_silent_after_the_job_closed_is_not_lost(make: Make, closer: str) -> None:
    """Once the job is closed (after the exit barrier, or failed), a member that stops
    beating is ending: its "done" may come late on a loaded machine, and it is never lost.
    The watcher knows it closed the job, or learns it from the store."""
    handlers = [make(2) for _ in range(2)]
    rendezvous_all(handlers)
    watcher = next(h for h in handlers if h.is_hosting)  # rank 0 judges every member
    silent = next(h for h in handlers if not h.is_hosting)
    (watcher if closer == "watcher" else silent).set_closed()
    assert wait_until(watcher.is_closed, 5)
    time.sleep(0.5)  # the watcher's monitor has read the closed mark
    silent._suspend_heartbeats()
    time.sleep(3.0)  # twice heartbeat_timeout
    assert watcher.lost_nodes() == []


def test_shutdown_of_a_running_job_is_a_departure_seen_within_a_tick(make: Make) -> None:
    handlers = [make(2, 3) for _ in range(3)]
    infos = rendezvous_all(handlers)
    leaver = next(h for h in handlers if not h.is_hosting)
    others = [h for h in handlers if h is not leaver]
    started = time.monotonic()
    leaver.shutdown()
    assert wait_until(lambda: all(h.lost_nodes() == [leaver.node_id] for h in others), 5)
    # heartbeat_interval=0.2: survivors learn of it on their next tick, not after a timeout
    assert time.monotonic() - started < 1.4
    assert all(h.membership_changed() for h in others)
    again = rendezvous_all(others)
    check_round(again, 2)
    assert again[0].round == infos[0].round + 1


def test_node_rank_hints_are_honoured(port: int) -> None:
    handlers = []
    for rank in (2, 0, 1):
        params = RendezvousParameters(
            "c10d", f"127.0.0.1:{port}", "job", 3, 3, config=dict(FAST), node_rank=rank
        )
        handlers.append(create_handler(params))
    try:
        infos = rendezvous_all(handlers)
        assert [i.rank for i in infos] == [2, 0, 1]
    finally:
        for h in sorted(handlers, key=lambda h: h.is_hosting):
            h.shutdown()


def test_non_json_state_names_the_key(make: Make, port: int) -> None:
    handler = make(1)
    raw_client(port).set("elastic/job/rdzv/round", "not json")
    with pytest.raises(RendezvousStateError, match="elastic/job/rdzv/round"):
        handler.next_rendezvous()


def test_non_json_join_record_names_the_key(make: Make, port: int) -> None:
    handler = make(2)
    store = raw_client(port)
    store.add("elastic/job/rdzv/r/0/count", 1)
    store.set("elastic/job/rdzv/r/0/join/1", b"\x80\x03pickle")
    with pytest.raises(RendezvousStateError, match="r/0/join/1"):
        handler.next_rendezvous()


HOST_SCRIPT = """
import sys, time, datetime
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", int(sys.argv[1]), None, True, datetime.timedelta(seconds=30),
             wait_for_workers=False, use_libuv=True)
print("ready", flush=True)
time.sleep(120)
"""


def test_store_host_dying_raises_connection_errors_quickly(make: Make, port: int) -> None:
    host = subprocess.Popen(
        [sys.executable, "-c", HOST_SCRIPT, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "ready"
        handlers = [make(2, is_host="false") for _ in range(2)]
        rendezvous_all(handlers)
        host.kill()
        host.wait()
        started = time.monotonic()

        def broken(h: C10dRendezvousHandler) -> bool:
            try:
                h.lost_nodes()
            except RendezvousConnectionError:
                return True
            return False

        assert wait_until(lambda: all(broken(h) for h in handlers), timeout=10)
        assert time.monotonic() - started < 5
        for call in (
            handlers[0].num_nodes_waiting,
            handlers[0].is_closed,
            handlers[0].next_rendezvous,
        ):
            with pytest.raises(
                RendezvousConnectionError, match="agent hosting the c10d store is gone"
            ):
                call()
    finally:
        host.kill()
        host.wait()


def test_a_store_that_comes_up_late_is_waited_for(make: Make, port: int) -> None:
    """Agents start at once on their machines; the store's may listen last. Before first
    contact, "connection refused" means "not up yet" (within read_timeout)."""
    with ThreadPoolExecutor(1) as pool:
        early = pool.submit(make, 2, is_host="false", read_timeout="5")
        time.sleep(1.0)
        assert not early.done()  # still waiting, not failed on "connection refused"
        host = make(2)
        assert host.is_hosting
        rendezvous_all([early.result(timeout=10), host])


def test_an_agent_hosts_once_the_endpoint_frees_up(make: Make, port: int) -> None:
    """Nobody listens, but the port is held for a moment (bound, not listening: a dying
    host, or another program's socket): an agent that may host takes the endpoint as soon
    as it frees, rather than waiting read_timeout for a listener that never comes."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))  # no SO_REUSEADDR, no listen(): blocks binding
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(make, 2, read_timeout="10")
        time.sleep(1.0)
        assert not first.done()
        squatter.close()
        handler = first.result(timeout=5)
    assert handler.is_hosting
    rendezvous_all([handler, make(2)])


def test_no_store_no_host_is_a_connection_error(port: int) -> None:
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "j", 1, 1, config={"is_host": "false", "read_timeout": "1"}
    )
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=str(port)):
        create_handler(params)
    assert time.monotonic() - started < 10


def test_host_shutdown_waits_for_the_other_members(make: Make) -> None:
    """Once the job is finished, the host serves until the others are out (a host that
    leaves a running job hands the store over instead)."""
    handlers = [make(2) for _ in range(2)]
    rendezvous_all(handlers)
    host = next(h for h in handlers if h.is_hosting)
    other = next(h for h in handlers if not h.is_hosting)
    host.set_closed()
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        done = pool.submit(host.shutdown)
        time.sleep(0.5)
        assert not done.done()
        other.shutdown()
        assert done.result(timeout=5)
        assert time.monotonic() - started < 3


def test_describe(make: Make) -> None:
    handlers = [make(2) for _ in range(2)]
    infos = rendezvous_all(handlers)
    claim_restart(infos[0].store, 0, "a")
    claim_restart(infos[1].store, 1, "b")
    status = handlers[0].describe()
    assert (status.state, status.round, status.min_nodes, status.max_nodes) == ("running", 0, 2, 2)
    assert [m.node_id for m in status.members] == by_rank(infos)
    assert status.restarts_used == 2
    assert all(m.heartbeat_age is not None and m.heartbeat_age < 5 for m in status.members)


def test_choose_members_prefers_previous_members_in_rank_order() -> None:
    def rec(node: str, hint: int | None = None) -> dict[str, Any]:
        return {"id": node, "addr": "a", "port": 1, "round": 0, "rank_hint": hint}

    chosen = R.choose_members([rec("new"), rec("b"), rec("a")], ["a", "b"], 2)
    assert [c["id"] for c in chosen] == ["a", "b"]
    chosen = R.choose_members([rec("x"), rec("y", 0), rec("z")], [], 3)
    assert [c["id"] for c in chosen] == ["y", "x", "z"]


def test_describe_from_a_read_only_handler(make: Make, port: int) -> None:
    handlers = [make(2, 3, last_call_timeout="0.5") for _ in range(2)]
    infos = rendezvous_all(handlers)
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "job", 1, 1, config={"is_host": "true"}, read_only=True
    )
    viewer = create_handler(params)  # read-only: connects even with is_host=true
    try:
        assert not viewer.is_hosting
        status = viewer.describe()
    finally:
        viewer.shutdown()
    assert (status.min_nodes, status.max_nodes, status.state) == (2, 3, "running")
    assert sorted(m.rank for m in status.members) == [0, 1]
    assert {m.pid for m in status.members} == {os.getpid()}
    assert [m.node_id for m in status.members] == by_rank(infos)
    with pytest.raises(Exception):  # noqa: B017 - read-only handlers never join
        viewer.next_rendezvous()


def two_of_five(make: Make) -> tuple[Any, Any, list[Any]]:
    """A formed 5-node round (``2:5``, a 30 s last call): two members that do not host
    the store, to take away, and the other three."""
    handlers = [make(2, 5, last_call_timeout="30") for _ in range(5)]
    check_round(rendezvous_all(handlers), 5)
    a, b = [h for h in handlers if not h.is_hosting][:2]
    return a, b, [h for h in handlers if h not in (a, b)]


def test_a_second_departure_during_the_regroup_is_not_waited_for(make: Make) -> None:
    """B leaves while the survivors of A's departure regroup: the coordinator reads the
    last round's lost list again when ``events`` moves, so nobody waits for B's last
    call (30 s here)."""
    a, b, rest = two_of_five(make)
    started = time.monotonic()
    a.leave()
    with ThreadPoolExecutor(len(rest)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in rest]
        time.sleep(0.5)
        b.leave()
        again = [f.result(timeout=20) for f in futures]
    check_round(again, 3)
    assert not {a.node_id, b.node_id} & set(round_members(rest[0], again[0]))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("how", ["crashed", "left unrecorded"])
def test_a_member_gone_during_the_regroup_is_not_waited_for(make: Make, how: str) -> None:
    """B dies while the survivors of A's departure regroup, and nobody lists it lost (a
    crash while no round runs; a departure whose ``lost`` write failed): the coordinator
    reads the heartbeats of the last round's members that are not back, and drops one
    whose value says it left or has not changed for heartbeat_timeout (1.5 s here)
    instead of waiting for the last call (30 s)."""
    a, b, rest = two_of_five(make)
    started = time.monotonic()
    a.leave()
    if how == "crashed":
        b._suspend_heartbeats()
        kill_presence(b)
    else:
        b.rdzv_store.set(R.hb_key(b.node_id), R.LEFT)
    with ThreadPoolExecutor(len(rest)) as pool:
        again = [f.result(timeout=20) for f in [pool.submit(h.next_rendezvous) for h in rest]]
    check_round(again, 3)
    assert not {a.node_id, b.node_id} & set(round_members(rest[0], again[0]))
    assert time.monotonic() - started < 1.5 + 5


def test_a_joiner_that_leaves_before_the_round_forms_is_not_a_member(make: Make, port: int) -> None:
    """A newcomer joined the regroup, then left (its heartbeat says so) before the round
    formed: the round forms without it instead of with a member that is already gone."""
    handlers = [make(2, 3, last_call_timeout="30") for _ in range(3)]  # no last call at first
    infos = rendezvous_all(handlers)
    check_round(infos, 3)
    a = next(h for h in handlers if not h.is_hosting)
    first, second = [h for h in handlers if h is not a]
    a.leave()
    with ThreadPoolExecutor(2) as pool:
        coordinating = pool.submit(first.next_rendezvous)  # slot 1: the coordinator
        time.sleep(0.3)
        rnd = infos[0].round + 1
        ghost = {"id": "ghost:1:x", "host": "ghost", "addr": "198.18.0.99", "port": 1}
        forge_join(port, "job", rnd, {**ghost, "round": rnd})
        raw_client(port).set(f"elastic/job/rdzv/{R.hb_key('ghost:1:x')}", "left")
        time.sleep(0.3)  # first and the ghost: min_nodes, but second is still expected
        joining = pool.submit(second.next_rendezvous)
        again = [coordinating.result(timeout=20), joining.result(timeout=20)]
    check_round(again, 2)
    assert "ghost:1:x" not in round_members(first, again[0])


def kill_presence(handler: C10dRendezvousHandler) -> None:
    """What the kernel does when the agent's process dies: its presence connections
    close without a goodbye, and its port stops answering."""
    server = handler._presence
    assert server is not None
    server._stop.set()
    server._wake_w.send(b"x")
    server._thread.join(timeout=5)
    for conn in list(server._conns.values()):
        conn.sock.close()
    server._sock.close()
    monitor = handler._monitor
    links = None if monitor is None else monitor.liveness.links
    clients = [] if links is None else [links.client, links.deputy_client]
    for client in clients:  # to rank 0 and to rank 1, the deputy
        if client is None:
            continue
        sock = client._sock
        client._stop.set()
        if sock is not None:  # shutdown: a close alone waits for the blocked recv
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.mark.parametrize("who", ["member", "rank 0"])
def test_a_dead_process_is_lost_at_once_not_after_heartbeat_timeout(make: Make, who: str) -> None:
    handlers = [make(2, 3, heartbeat_timeout="30") for _ in range(3)]
    infos = rendezvous_all(handlers)
    check_round(infos, 3)
    rank = {h: i.rank for h, i in zip(handlers, infos, strict=True)}
    victim = next(h for h in handlers if (rank[h] == 0) == (who == "rank 0"))
    others = [h for h in handlers if h is not victim]
    time.sleep(0.5)  # every member is connected to rank 0
    victim._suspend_heartbeats()
    started = time.monotonic()
    kill_presence(victim)
    assert wait_until(lambda: all(victim.node_id in h.lost_nodes() for h in others), 10)
    assert time.monotonic() - started < 2.5  # heartbeat_timeout is 30 s


def test_a_member_that_never_connects_is_asked_and_lost_only_when_its_port_refuses(
    make: Make,
) -> None:
    """A member killed after it joined a round, before it learnt the round formed, leaves
    no presence connection to close. Rank 0 asks the port of a member that has not
    connected ``CONNECT_WAIT`` into the round: refused, it is lost at once; a port that
    answers (a live member slow to connect) is left to its heartbeat."""
    handlers = [make(2, 3, heartbeat_timeout="30") for _ in range(3)]
    for h in handlers:  # nobody connects to rank 0
        assert h._monitor is not None
        h._monitor.liveness.links.hello = None
    infos = rendezvous_all(handlers)
    formed = time.monotonic()
    check_round(infos, 3)
    alive, dead = [h for h, i in zip(handlers, infos, strict=True) if i.rank > 0]
    dead._suspend_heartbeats()
    kill_presence(dead)
    others = [h for h in handlers if h is not dead]
    assert wait_until(lambda: all(h.lost_nodes() == [dead.node_id] for h in others), 10)
    assert time.monotonic() - formed < CONNECT_WAIT + 1.5  # heartbeat_timeout is 30 s
    time.sleep(1.0)
    assert all(h.lost_nodes() == [dead.node_id] for h in others)  # not the live one


def test_a_presence_connection_that_comes_back_is_not_a_death(make: Make) -> None:
    handlers = [make(2, 3, heartbeat_timeout="30") for _ in range(3)]
    infos = rendezvous_all(handlers)
    members = [h for h, i in zip(handlers, infos, strict=True) if i.rank > 0]
    time.sleep(0.5)
    for h in members:  # a blip: the connection closes under a live client
        assert h._monitor is not None and h._monitor.liveness.links.client is not None
        sock = h._monitor.liveness.links.client._sock
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)
    time.sleep(2.0)  # four times the grace
    assert all(h.lost_nodes() == [] for h in handlers)


def test_the_store_moves_when_its_host_leaves(make: Make) -> None:
    """The hosting agent leaves on notice: it hands every key to the first member's
    standby store, the others follow it there, regroup without it and can finish."""
    handlers = [make(2, 3) for _ in range(3)]
    infos = rendezvous_all(handlers)
    check_round(infos, 3)
    host = next(h for h in handlers if h.is_hosting)
    others = [h for h in handlers if h is not host]
    assert not any(h.is_hosting for h in others)
    started = time.monotonic()
    host.leave()
    assert wait_until(lambda: all(h.lost_nodes() == [host.node_id] for h in others), 5)
    again = rendezvous_all(others)
    check_round(again, 2)
    assert time.monotonic() - started < 3
    assert host.node_id not in round_members(others[0], again[0])
    assert again[0].round == infos[0].round + 1  # the round counter came along
    assert [h.is_hosting for h in others].count(True) == 1
    others[0].set_closed()
    assert wait_until(lambda: all(h.is_closed() for h in others), 5)
    host.shutdown()


def test_a_joiner_finds_the_moved_store_at_another_candidate_endpoint(port: int) -> None:
    """``--rdzv-endpoint=A,B``: A's agent hosts, another agent keeps its standby on B. A
    leaves: the store moves to B, where a node that joins afterwards finds it."""
    endpoint = f"127.0.0.1:{port},127.0.0.1:{free_port()}"

    def make_on_both() -> C10dRendezvousHandler:
        params = RendezvousParameters(
            "c10d", endpoint, "job", 2, 3, config={**FAST, "last_call_timeout": "1"}
        )
        handler = create_handler(params)
        assert isinstance(handler, C10dRendezvousHandler)
        return handler

    first, second = make_on_both(), make_on_both()
    late: C10dRendezvousHandler | None = None
    try:
        check_round(rendezvous_all([first, second]), 2)
        host = next(h for h in (first, second) if h.is_hosting)
        other = first if host is second else second
        host.leave()
        assert wait_until(lambda: other.is_hosting, 5)  # its standby took the store
        late = make_on_both()  # knows only the endpoints: A refuses, B has the job
        again = rendezvous_all([other, late])
        check_round(again, 2)
        assert again[0].round >= 1 and host.node_id not in round_members(other, again[0])
    finally:
        for h in (late, first, second):
            if h is not None:
                h.shutdown()


@pytest.mark.parametrize("fails_at", [1, 2, 3])
def test_a_handler_that_cannot_be_made_closes_what_it_opened(port: int, fails_at: int) -> None:
    """``open_round_handler`` (the etcd backends'): the job's store does not answer, or
    Ctrl-C comes while the monitor's or the keep-alives' connection is made; every
    connection made before that is closed, none is left open."""
    from elastic.core.rendezvous.round.handler import open_round_handler
    from elastic.core.rendezvous.round.settings import parse_round_settings
    from elastic.core.tcpstore import TCPStoreServer
    from elastic.core.tcpstore.view import Connection, PrefixStore

    server = TCPStoreServer("127.0.0.1", port)
    params = RendezvousParameters("etcd-v3", f"127.0.0.1:{port}", "job", 1, 1)
    made: list[Connection] = []

    def connect() -> PrefixStore:
        if len(made) + 1 == fails_at and fails_at > 1:
            raise KeyboardInterrupt
        made.append(Connection("127.0.0.1", port, timeout=5.0))
        return PrefixStore(made[-1], "elastic/job/")

    def reach(store: PrefixStore) -> str:
        if fails_at == 1:
            raise RendezvousConnectionError("the store does not answer")
        store.check(["rdzv/round"])
        return "127.0.0.1"

    try:
        error = RendezvousConnectionError if fails_at == 1 else KeyboardInterrupt
        with pytest.raises(error):
            open_round_handler(params, parse_round_settings(params, ()), "test", connect, reach)
        assert len(made) == max(1, fails_at - 1)
        assert all(conn._closed for conn in made)
    finally:
        server.close()


@pytest.mark.parametrize("case", ["kept-waiting", "member-back-new", "plain-join", "restarted"])
def test_after_a_loss_the_kept_members_form_a_round_first(make: Make, case: str) -> None:
    """After a loss, survivors whose workers are kept form the round alone, so their
    workers train while new ones start elsewhere; the node with new workers waits for the
    next round, which the survivors see as a node waiting (and which does not make their
    own round superseded: ``deferred``), and all three form it. The loss is a member that
    left while a newcomer joins, the survivors knowing their group lost it
    (``kept-waiting``); or a member back with new workers (fenced, crashed), which they
    may not know (``member-back-new``). A plain join (``plain-join``: the group whole)
    and survivors that restart their workers anyway take everyone into one round."""
    handlers = [make(2, 4, last_call_timeout="1") for _ in range(3)]
    infos = rendezvous_all(handlers)
    check_round(infos, 3)
    round_ = infos[0].round
    c = next(h for h in handlers if not h.is_hosting)  # the store stays where it is
    a, b = survivors = [h for h in handlers if h is not c]
    a_peers = a.round_peers()  # the other members of a's workers' group
    assert a_peers is not None and c.node_id in a_peers
    if case == "member-back-new":
        late = c  # its workers were stopped: it rejoins with new ones
        others = survivors
    else:
        late = make(2, 4, last_call_timeout="1")
        others = survivors if case != "plain-join" else handlers
        if case != "plain-join":
            c.leave()
    with ThreadPoolExecutor(4) as pool:
        late.set_workers_kept(False)
        joined = pool.submit(late.next_rendezvous)
        assert wait_until(lambda: a.num_nodes_waiting() > 0, 5)  # it took its slot
        for h in others:
            h.set_workers_kept(case != "restarted", case == "kept-waiting", round_)
        again = [f.result(timeout=10) for f in [pool.submit(h.next_rendezvous) for h in others]]
        # a's workers are told their group is broken at once only when the round left
        # one of its members for the next one (``left_out_a_peer``)
        a_info = again[others.index(a)]
        left_out = left_out_a_peer(a, a_info.deferred, a_peers)
        assert left_out is (case not in ("plain-join", "restarted"))
        if case in ("plain-join", "restarted"):
            check_round([*again, joined.result(timeout=10)], len(others) + 1)
            assert {i.deferred for i in again} == {0}
            return
        check_round(again, 2)
        assert late.node_id not in round_members(a, again[0])
        assert {i.deferred for i in again} == {1}  # its waiting supersedes nothing
        assert not joined.done()
        assert wait_until(lambda: a.num_nodes_waiting() > 0, 5)  # the next round's joiner
        for h in survivors:  # their new group is whole: they train on in it
            h.set_workers_kept(True, False, again[0].round)
        third = [pool.submit(h.next_rendezvous) for h in survivors]
        check_round([*(f.result(timeout=10) for f in third), joined.result(timeout=10)], 3)


def test_kept_first_leaves_new_workers_for_the_next_round_only_when_the_kept_suffice() -> None:
    def rec(node: str, kept: bool = False, waiting: bool = False, at: int = 2) -> dict[str, Any]:
        return {"id": node, "addr": "a", "port": 1, "round": 3, "kept": kept,
                "waiting": waiting, "workers_round": at if kept else None}  # fmt: skip

    new, back = rec("n1"), rec("m3")  # a newcomer; a member of round 2 with new workers
    waits = [rec("k1", kept=True, waiting=True), rec("k2", kept=True)]
    trains = [rec("k1", kept=True), rec("k2", kept=True)]
    members = ["k1", "k2", "m3"]
    ids = lambda recs: [r["id"] for r in recs]  # noqa: E731
    assert ids(R.kept_first([new, *waits], 2, 2, members)) == ["k1", "k2"]
    assert ids(R.kept_first([back, *trains], 2, 2, members)) == ["k1", "k2"]
    # fewer kept nodes than min_nodes wait for new workers anyway: everyone
    assert R.kept_first([new, *waits], 3, 2, members) == [new, *waits]
    # a plain join; kept workers of an older round (a second joiner); plain scripts
    assert R.kept_first([*trains, new], 1, 2, members) == [*trains, new]
    old = [rec("k1", kept=True, at=1), rec("k2", kept=True, at=1)]
    assert R.kept_first([*old, back], 1, 2, members) == [*old, back]
    assert R.kept_first([new, back], 1, 2, members) == [new, back]
