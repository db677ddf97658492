"""Attacks by a client without the job token, on real stores it can write to (torch's own
TCPStore server, etcd without auth): a forged signature of non-ASCII bytes stops no agent,
and no replay of an older signed value takes back a decision (restart budget, failed flag,
lost list, closed), on every backend that signs its records."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from elastic.core.agent.restarts import claim_restart, give_up, job_failed, restarts_used
from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.job_keys import BUDGET_KEY, FAILED_KEY
from elastic.core.rendezvous.round import presence
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.liveness import add_lost, read_lost
from elastic.core.rendezvous.round.signing import SignedStore
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.harness.processes import Processes
from elastic.plugins.rdzv_etcd.client import ClientConfig, EtcdClient
from elastic.plugins.rdzv_etcd.store import EtcdStore
from elastic.plugins.rdzv_etcd_v3.client import V3Config
from elastic.plugins.rdzv_etcd_v3.store import EtcdV3Store
from elastic.testing.waits import wait_until

pytest_plugins = ["elastic.testing.etcd"]

TOKEN = b"the-job-token"
NON_ASCII_SIGNATURE = b"#s1:" + "\u00e9".encode() * 32 + b":x"  # 64 bytes, none ASCII


class Backend:
    """Raw stores on one real server, all under one job's keys: ``raw()`` is what an
    attacker without the token uses, ``node()`` a node's signed view (its own memory)."""

    def __init__(self, raw: Callable[[], CoordinationStore]) -> None:
        self.raw = raw
        self.made: list[CoordinationStore] = []

    def node(self) -> SignedStore:
        store = SignedStore(self.raw(), TOKEN, "job")
        self.made.append(store)
        return store

    def attacker(self) -> CoordinationStore:
        store = self.raw()
        self.made.append(store)
        return store


@pytest.fixture(params=["torch-tcpstore", "etcd-v3", "etcd-v2"])
def backend(request: Any, port: int) -> Iterator[Backend]:
    if request.param == "torch-tcpstore":
        from torch.distributed import TCPStore

        server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), use_libuv=True)
        made = Backend(lambda: PrefixStore(Connection("127.0.0.1", port, 10.0), "elastic/job/"))
    else:
        etcd = request.getfixturevalue("etcd_server_shared")
        prefix = f"/replay/{request.node.name}/{time.monotonic_ns()}/"
        if request.param == "etcd-v3":
            made = Backend(lambda: EtcdV3Store(V3Config(etcd.endpoint), prefix))
        else:
            made = Backend(
                lambda: EtcdStore(EtcdClient(ClientConfig(etcd.endpoint)), prefix.rstrip("/"))
            )
        server = None
    yield made
    for store in made.made:
        store.close()
    del server


def test_a_replayed_restart_budget_gives_no_restart_back(backend: Backend) -> None:
    node, attacker = backend.node(), backend.attacker()
    assert claim_restart(node, 0, "a") == 1
    older = attacker.multi_get([BUDGET_KEY])[0]  # signed, version 1
    assert claim_restart(node, 1, "a") == 2
    attacker.set(BUDGET_KEY, older)
    # The node that saw 2 restarts used never reads fewer, and puts the newer record back:
    assert restarts_used(node) == 2
    assert attacker.multi_get([BUDGET_KEY])[0] != older
    # so a node that never read it sees it too, and the next claim counts from it.
    assert restarts_used(backend.node()) == 2
    attacker.set(BUDGET_KEY, older)
    assert claim_restart(node, 2, "a") == 3
    assert restarts_used(backend.node()) == 3


def test_a_deleted_or_replaced_failed_flag_still_ends_the_job(backend: Backend) -> None:
    node, attacker = backend.node(), backend.attacker()

    class Handler:  # give_up closes the rendezvous too: not this test's concern
        def set_closed(self) -> None:
            pass

    give_up(node, Handler())  # type: ignore[arg-type]
    assert job_failed(node)
    attacker.delete_key(FAILED_KEY)
    assert job_failed(node)  # the node that saw the flag keeps seeing it
    assert job_failed(backend.node())  # and wrote it back
    attacker.set(FAILED_KEY, NON_ASCII_SIGNATURE)
    assert job_failed(node)


def test_a_replayed_lost_list_declares_nobody_alive_again(backend: Backend) -> None:
    node, attacker = backend.node().sub("rdzv/"), backend.attacker()
    key = "rdzv/" + R.lost_key(0)
    assert add_lost(node, 0, ["a"]) == ["a"]
    older = attacker.multi_get([key])[0]
    assert add_lost(node, 0, ["b"]) == ["a", "b"]
    attacker.set(key, older)
    assert read_lost(node, 0) == ["a", "b"]
    assert read_lost(backend.node().sub("rdzv/"), 0) == ["a", "b"]


def test_a_replayed_closed_flag_cannot_be_taken_away(backend: Backend) -> None:
    node, attacker = backend.node().sub("rdzv/"), backend.attacker()
    node.set(R.CLOSED, R.closed_record("a"))
    attacker.delete_key("rdzv/" + R.CLOSED)
    assert node.check([R.CLOSED])
    assert backend.node().sub("rdzv/").check([R.CLOSED])


def test_a_forged_non_ascii_signature_fails_no_read(backend: Backend) -> None:
    node, attacker = backend.node(), backend.attacker()
    for key in (FAILED_KEY, BUDGET_KEY, "rdzv/closed", "rdzv/r/0/assignment"):
        attacker.set(key, NON_ASCII_SIGNATURE)
        assert node.multi_get([key]) == [b""]  # foreign: absent
    assert restarts_used(node) == 0
    assert not job_failed(node)


# --- the attack, end to end: three agents of a token job on torch's store --------

TRAIN = """
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"TRAINING rank={dist.get_rank()}", flush=True)
dist.destroy_process_group()
stop = os.environ["STOP_FILE"]
while not os.path.exists(stop):
    time.sleep(0.1)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_non_ascii_signature_at_the_failed_flag_stops_no_agent(
    procs: Processes, port: int, tmp_path: Path
) -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), use_libuv=True)
    script, stop = tmp_path / "train.py", tmp_path / "stop"
    script.write_text(TRAIN)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        STOP_FILE=str(stop),
        ELASTIC_RDZV_TOKEN="the-job-token",
        RES_OPTIONS="timeout:1 attempts:1",
    )
    # is_host=false: a token job takes a store that cannot prove the token (torch's) only
    # when told that no agent hosts it.
    conf = "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=1,is_host=false"
    agents = [
        procs.elastic(
            "run",
            "--nnodes=3",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=attacked",
            f"--rdzv-conf={conf}",
            "--monitor-interval=0.1",
            str(script),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(3)
    ]
    outputs = [tmp_path / f"agent-{i}.log" for i in range(3)]
    readers = [_drain(a, out) for a, out in zip(agents, outputs, strict=True)]
    assert wait_until(lambda: all("TRAINING" in o.read_text() for o in outputs), 150), [
        o.read_text()[-2000:] for o in outputs
    ]
    for _ in range(2):  # the attack, twice
        server.set("elastic/attacked/" + FAILED_KEY, NON_ASCII_SIGNATURE)
        server.add("elastic/attacked/rdzv/events", 1)
        time.sleep(3)  # several monitor ticks and job-watch reads
    assert [a.poll() for a in agents] == [None, None, None], [o.read_text() for o in outputs]
    stop.touch()
    codes = [a.wait(60) for a in agents]
    for reader in readers:
        reader.join(10)
    texts = [o.read_text() for o in outputs]
    assert codes == [0, 0, 0], texts
    assert not any("TypeError" in t or "Traceback" in t for t in texts), texts
    assert any("ignoring elastic/attacked/agent/failed" in t for t in texts), texts
    del server


def _drain(proc: subprocess.Popen[Any], out: Path) -> Any:
    import threading

    def read() -> None:
        assert proc.stdout is not None
        with out.open("wb") as f:
            for line in proc.stdout:
                f.write(line if isinstance(line, bytes) else line.encode())
                f.flush()

    out.touch()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_hello_refuses_any_signature_shape() -> None:
    line = presence.hello_line(TOKEN, "job", "n", 0, "c1")
    assert presence.read_hello(TOKEN, "job", line, "c1", 0) == ("n", 0)
    record = json.loads(line)
    for sig in ("\u00e9" * 64, "\ud800", 5, None, record["sig"][:-1] + "0"):
        forged = json.dumps({**record, "sig": sig}).encode()
        assert isinstance(presence.read_hello(TOKEN, "job", forged, "c1", 0), str), sig
    assert isinstance(presence.read_hello(TOKEN, "job", b'["not", "a", "dict"]', "c1", 0), str)
