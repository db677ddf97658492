"""A joiner killed between taking its join slot (the ``add`` on the round's counter) and
writing its join record leaves a slot taken and empty. The others must not wait
``read_timeout`` for it: a reader that finds a slot still empty after a short bound claims
it empty with a ``compare_set`` from absent, and a writer that finds its slot so claimed
takes another (``core/rendezvous/round/joining.py``). Real stores: c10d on loopback,
etcd-v3 and etcd-v2 started by the fixtures; handlers as threads."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest
from elastic.core.rendezvous.round import records as R
from elastic.testing.conformance import Nodes, RendezvousTarget, assert_one_round, rendezvous_all
from elastic.testing.waits import wait_until

if TYPE_CHECKING:
    from elastic.testing.etcd import EtcdCluster

pytest_plugins = ["elastic.testing.etcd"]

READ_TIMEOUT = 10.0  # what a taken, empty slot cost every reader before
QUICK = {
    "last_call_timeout": "1",
    "heartbeat_interval": "0.5",
    "heartbeat_timeout": "3",
    "close_timeout": "2",
    "join_timeout": "60",
    "read_timeout": str(READ_TIMEOUT),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=["c10d", "etcd-v3", "etcd-v2"])
def nodes(request: pytest.FixtureRequest) -> Iterator[Nodes]:
    if request.param == "c10d":  # the first handler made hosts the store
        endpoint = f"127.0.0.1:{_free_port()}"
    else:
        fixture = "etcd_v3_server_shared" if request.param == "etcd-v3" else "etcd_server_shared"
        server: EtcdCluster = request.getfixturevalue(fixture)
        endpoint = server.endpoint
    made = Nodes(RendezvousTarget(request.param, endpoint, dict(QUICK)))
    yield made
    made.close()


def _run_id() -> str:
    return f"slot-{uuid.uuid4().hex[:10]}"


def _take_slot_and_die(handler: Any, rnd: int) -> int:
    """What a joiner SIGKILLed right after its ``add`` left behind: a slot, no record."""
    return int(handler.rdzv_store.add(R.count_key(rnd), 1))


@pytest.mark.parametrize("token", [None, "job-token"])
def test_a_dead_first_slot_does_not_stall_the_round(
    nodes: Nodes, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if token is not None:  # signed records: the claim is signed and checked as one
        monkeypatch.setenv("ELASTIC_RDZV_TOKEN", token)
    run_id = _run_id()
    a, b = nodes.make(run_id, 2, 2, n=2)
    assert (a.rdzv_store.token is None) == (token is None)
    (ghost,) = nodes.make(run_id, 2, 2)
    assert _take_slot_and_die(ghost, 0) == 1  # the coordinator's slot
    started = time.monotonic()
    infos = rendezvous_all([a, b])
    took = time.monotonic() - started
    assert_one_round(infos, 2)
    assert took < 3.0, f"the round took {took:.1f}s with read_timeout={READ_TIMEOUT:g}s"
    (raw,) = a.rdzv_store.multi_get([R.join_key(0, 1)])
    assert R.is_empty_slot(R.loads(raw, "slot 1"))  # claimed empty, for every later reader


def test_a_dead_slot_between_two_joiners_does_not_stall_the_round(nodes: Nodes) -> None:
    run_id = _run_id()
    a, b = nodes.make(run_id, 2, 2, n=2)
    (ghost,) = nodes.make(run_id, 2, 2)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(a.next_rendezvous)
        assert wait_until(lambda: a.rdzv_store.check([R.join_key(0, 1)]), 10)
        assert _take_slot_and_die(ghost, 0) == 2
        started = time.monotonic()
        second = b.next_rendezvous()
        infos = [first.result(timeout=30), second]
        took = time.monotonic() - started
    assert_one_round(infos, 2)
    assert took < 3.0, f"the round took {took:.1f}s with read_timeout={READ_TIMEOUT:g}s"


def test_a_writer_whose_slot_was_claimed_empty_takes_another(nodes: Nodes) -> None:
    """The other side of the race: a live joiner too slow to write its record before a
    reader claimed its slot is not skipped silently; it finds the claim and joins at the
    next slot."""
    run_id = _run_id()
    a, b = nodes.make(run_id, 2, 2, n=2)
    claimed = a.rdzv_store.compare_set(R.join_key(0, 1), "", R.EMPTY_SLOT)
    assert claimed == R.EMPTY_SLOT.encode()
    infos = rendezvous_all([a, b])
    assert_one_round(infos, 2)
    joined = a.rdzv_store.multi_get([R.join_key(0, i) for i in (2, 3)])
    assert {R.loads(raw, "join")["id"] for raw in joined} == {i.node_id for i in infos}
