"""The static rendezvous backend against real TCPStores on free loopback ports."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from elastic.plugins.rdzv_static import create_handler, parse_endpoint
from elastic.plugins.rdzv_static.handler import ARRIVALS, round_key


def params(rank: int | None, port: int, nnodes: int = 2, **conf: str) -> RendezvousParameters:
    config = dict(conf)
    if rank is not None:
        config["rank"] = str(rank)
    return RendezvousParameters(
        backend="static",
        endpoint=f"127.0.0.1:{port}",
        run_id="job1",
        min_nodes=nnodes,
        max_nodes=nnodes,
        config=config,
    )


def rendezvous_all(handlers, rounds: int = 1) -> list[list[RendezvousInfo]]:
    """Run ``rounds`` rounds on every handler concurrently, one thread per node."""

    def node(h) -> list[RendezvousInfo]:  # noqa: ANN001
        return [h.next_rendezvous() for _ in range(rounds)]

    with ThreadPoolExecutor(len(handlers)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(node, h) for h in handlers]]


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, elastic.plugins.rdzv_static as m, elastic.plugins.rdzv_static.handler\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_two_nodes_ranks_and_the_store_for_the_workers(port: int) -> None:
    handlers = [create_handler(params(r, port, timeout="30")) for r in (0, 1)]
    try:
        node0, node1 = rendezvous_all(handlers, rounds=3)
        for r in range(3):
            a, b = node0[r], node1[r]
            assert (a.rank, b.rank) == (0, 1)
            assert a.world_size == b.world_size == 2
            assert a.round == b.round == r
            # Every round's workers are clients of node 0's store, as under torchrun.
            assert a.master_addr == b.master_addr == "127.0.0.1"
            assert a.master_port == b.master_port == port
            assert a.members == b.members and len(set(a.members)) == 2
        assert all(h.use_agent_store for h in handlers)
        # Job-wide keys the agent writes are visible to the other node, namespaced by run.
        node0[-1].store.set("agent/restarts", json.dumps(1))
        assert json.loads(node1[-1].store.get("agent/restarts")) == 1
        assert node1[-1].store.add("agent/failures/n", 1) == 1
        assert node0[-1].store.add("agent/failures/n", 1) == 2
    finally:
        assert all(rendezvous_all_shutdown(handlers))


def rendezvous_all_shutdown(handlers) -> list[bool]:  # noqa: ANN001
    with ThreadPoolExecutor(len(handlers)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(h.shutdown) for h in handlers]]


def test_config_errors(port: int) -> None:
    with pytest.raises(RendezvousConfigError, match=r"accepted: .*node_rank.*rank.*timeout"):
        create_handler(params(0, port, join_timeout="5"))
    p = params(0, port)
    p.min_nodes = 1
    with pytest.raises(RendezvousConfigError, match="fixed number of nodes"):
        create_handler(p)
    with pytest.raises(RendezvousConfigError, match="--node-rank"):
        create_handler(params(None, port))
    with pytest.raises(RendezvousConfigError, match="out of range"):
        create_handler(params(2, port))
    with pytest.raises(RendezvousConfigError, match="disagree"):
        create_handler(params(0, port, node_rank="1"))
    with pytest.raises(RendezvousConfigError, match="timeout"):
        create_handler(params(0, port, timeout="0"))
    # node_rank is accepted as an alias, and one node needs no rank at all.
    assert create_handler(params(None, port, node_rank="1")).rank == 1  # type: ignore[attr-defined]
    assert create_handler(params(None, port, nnodes=1)).rank == 0  # type: ignore[attr-defined]


def test_parse_endpoint() -> None:
    assert parse_endpoint("") == ("127.0.0.1", 29500)
    assert parse_endpoint("node7") == ("node7", 29500)
    assert parse_endpoint("10.0.0.1:1234") == ("10.0.0.1", 1234)
    assert parse_endpoint("[::1]:1234") == ("::1", 1234)
    with pytest.raises(RendezvousConfigError):
        parse_endpoint("host:notaport")


def _master_store(port: int):  # noqa: ANN202
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)


def test_bad_json_names_the_key(port: int) -> None:
    server = _master_store(port)  # plays node 0, which wrote garbage
    server.set("job1/" + ARRIVALS, "1")
    server.set("job1/" + round_key(0, "assignment"), "{not json")
    handler = create_handler(params(1, port, timeout="10"))
    with pytest.raises(RendezvousStateError, match=r"job1/rdzv/round/0/assignment"):
        handler.next_rendezvous()
    handler.shutdown()


def test_duplicate_rank_is_refused(port: int) -> None:
    server = _master_store(port)
    first = create_handler(params(1, port, nnodes=3, timeout="10"))
    second = create_handler(params(1, port, nnodes=3, timeout="10"))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(first.next_rendezvous)  # blocks: nodes 0 and 2 never come
        time.sleep(0.5)
        with pytest.raises(RendezvousConfigError, match="already taken"):
            second.next_rendezvous()
        # Another node closing the job wakes the waiting one instead of a 10 s timeout.
        second.set_closed()
        start = time.monotonic()
        with pytest.raises(RendezvousClosedError):
            waiting.result(timeout=10)
        assert time.monotonic() - start < 3
    assert first.is_closed() and second.is_closed()
    del server


def test_unreachable_master_fails_fast_with_one_line(port: int) -> None:
    nobody = port  # free: nothing listens there
    handler = create_handler(params(1, nobody, timeout="2"))
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        handler.next_rendezvous()
    elapsed = time.monotonic() - start
    assert elapsed < 4, elapsed
    message = str(info.value)
    assert "\n" not in message
    assert f"127.0.0.1:{nobody}" in message and "node rank 0" in message


def test_node_started_before_node_zero_waits_for_it(port: int) -> None:
    handlers = [create_handler(params(r, port, timeout="30")) for r in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(handlers[1].next_rendezvous)
        time.sleep(1.0)  # node 1 keeps retrying the connection meanwhile
        assert not early.done()
        late = pool.submit(handlers[0].next_rendezvous)
        assert early.result(timeout=30).master_port == late.result(timeout=30).master_port
        shutdowns = [pool.submit(h.shutdown) for h in handlers]
        assert all(f.result(timeout=30) for f in shutdowns)


def test_round_times_out_when_a_node_never_comes(port: int) -> None:
    handler = create_handler(params(0, port, timeout="1"))
    with pytest.raises(RendezvousTimeoutError, match=r"1 of 2 nodes arrived"):
        handler.next_rendezvous()
    handler.shutdown_timeout = timedelta(seconds=0.5)  # type: ignore[attr-defined]
    handler.set_closed()  # the job is over: node 0 waits (bounded) for the others
    start = time.monotonic()
    assert handler.shutdown() is False  # node 1 never finished: bounded, then reported
    assert time.monotonic() - start < 3


def test_node_zero_leaving_an_open_job_waits_for_nobody(port: int) -> None:
    handler = create_handler(params(0, port, timeout="1"))
    with pytest.raises(RendezvousTimeoutError):
        handler.next_rendezvous()
    start = time.monotonic()
    assert handler.shutdown() is True  # e.g. SIGTERMed: leave at once, job not closed
    assert time.monotonic() - start < 1


def test_master_port_in_use(port: int) -> None:
    busy = _master_store(port)
    handler = create_handler(params(0, port, timeout="2"))
    with pytest.raises(RendezvousConnectionError, match="cannot host"):
        handler.next_rendezvous()
    del busy


def test_early_arrival_is_reported_as_waiting_and_status_reads_it(port: int) -> None:
    """A node that restarts after a failure shows up as waiting on the other node."""
    handlers = [create_handler(params(r, port, timeout="30")) for r in (0, 1)]
    node0, node1 = handlers
    try:
        rendezvous_all(handlers)
        assert node0.num_nodes_waiting() == node1.num_nodes_waiting() == 0
        with ThreadPoolExecutor(1) as pool:
            again = pool.submit(node1.next_rendezvous)  # node 1's workers failed
            time.sleep(0.3)
            assert node0.num_nodes_waiting() == 1  # node 0's agent stops and rejoins
            viewer = create_handler(
                RendezvousParameters(
                    backend="static",
                    endpoint=f"127.0.0.1:{port}",
                    run_id="job1",
                    min_nodes=1,
                    max_nodes=1,
                    read_only=True,
                )
            )
            status = viewer.describe()
            assert viewer.shutdown()
            assert (status.state, status.round, status.waiting) == ("waiting", 0, 1)
            assert [m.rank for m in status.members] == [0, 1]
            assert status.members[1].node_id == node0.next_rendezvous().members[1]
            assert again.result(timeout=30).round == 1
        assert node0.num_nodes_waiting() == 0
    finally:
        assert all(rendezvous_all_shutdown(handlers))


# -- end to end: two agents on loopback, the way torchrun's default backend is used ----
# (jobs whose workers use the agent's store: test_rdzv_static_workers.py)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_e2e_sigterm_while_waiting_for_nodes_exits_promptly(procs, tmp_path, port: int) -> None:  # noqa: ANN001
    # Node 0 alone: it hosts the store and waits for node 1. torch's blocking store wait
    # would hold off the agent's SIGTERM handler for the whole rendezvous timeout.
    import signal
    import socket

    from elastic.testing.waits import wait_until

    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    node0 = procs.elastic(
        "run",
        "--nnodes=2",
        "--node-rank=0",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--nproc-per-node=1",
        str(script),
    )

    def listening() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    assert wait_until(listening, timeout=60)
    time.sleep(0.5)  # into the round's wait
    node0.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, stderr = node0.communicate(timeout=30)
    assert time.monotonic() - start < 5
    assert node0.returncode == 128 + signal.SIGTERM, stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_e2e_a_departed_node_ends_a_static_job_promptly(procs, tmp_path, port: int) -> None:  # noqa: ANN001
    # Fixed membership cannot regroup: when node 1 is SIGTERMed, node 0 must end with one
    # line saying why, not wait for node 1 in the next round until the 600 s timeout
    # (--max-restarts leaves room for a restart, which is what would wait).
    import signal

    from elastic.testing.waits import wait_until

    script = tmp_path / "sleepy.py"
    script.write_text("import os, sys, time\nprint('RUNNING', flush=True)\ntime.sleep(600)\n")
    nodes = [
        procs.elastic(
            "run",
            "--nnodes=2",
            f"--node-rank={rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--max-restarts=3",
            str(script),
        )
        for rank in (0, 1)
    ]
    lines: list[str] = []

    def running() -> bool:
        line = nodes[0].stdout.readline()
        lines.append(line)
        return "RUNNING" in line

    assert wait_until(running, timeout=60), lines
    nodes[1].send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, stderr = nodes[0].communicate(timeout=60)
    took = time.monotonic() - start
    assert nodes[0].returncode == 1, stderr
    assert took < 10, took
    assert "node rank 1" in stderr and "left the job" in stderr, stderr
    nodes[1].communicate(timeout=30)
    assert nodes[1].returncode == 128 + signal.SIGTERM
