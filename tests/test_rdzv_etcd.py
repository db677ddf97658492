"""etcd and etcd-v2 backends (the shared round over etcd's v2 API) against real etcd servers:
faults (restart, a lost member of three, unreachable), TLS, authentication, corrupt state,
fingerprints, describe, and the ``etcd`` backend's torch keys (mapped or refused)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import etcd
import pytest
from elastic.core.agent.restarts import claim_restart
from elastic.core.interfaces.rendezvous import (
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousMismatchError,
    RendezvousParameters,
    RendezvousStateError,
)
from elastic.core.rendezvous.registry import get_rendezvous_handler
from elastic.plugins.rdzv_etcd.client import parse_endpoints
from elastic.testing.conformance import by_rank

if TYPE_CHECKING:
    from elastic.testing.etcd import EtcdCluster

pytest_plugins = ["elastic.testing.etcd"]

QUICK = {
    "etcd-v2": {"last_call_timeout": "1", "keep_alive_interval": "0.5",
                "keep_alive_max_attempt": "4", "join_timeout": "40"},
    "etcd": {"last_call_timeout": "1", "keep_alive_interval": "0.5",
             "keep_alive_max_attempt": "4", "timeout": "40"},  # torch's name: join_timeout
}  # fmt: skip
TLS_KEYS = {
    "etcd-v2": ("ca_cert", "ssl_cert", "ssl_cert_key"),
    "etcd": ("cacert", "cert", "key"),
}
BACKENDS = ["etcd-v2", "etcd"]
# ``etcd`` is ``etcd-v2``'s code under torch's names and keys: both run what a name or a
# key changes; what etcd itself does to the round (a restart, a member lost) runs once.
ROUND_UNDER_ETCD = ["etcd-v2"]
PREFIX = {"etcd-v2": "/elastic/rdzv", "etcd": "/elastic/etcd"}  # each backend's default


def params(backend: str, endpoint: str, run_id: str, n: int = 2, **conf: Any) -> Any:
    config = {**QUICK[backend], **{k: str(v) for k, v in conf.items()}}
    fingerprint = conf.pop("fingerprint", None) if "fingerprint" in conf else None
    return RendezvousParameters(
        backend, endpoint, run_id, n, n, local_addr="127.0.0.1", config=config,
        fingerprint=fingerprint or {},
    )  # fmt: skip


def handlers(backend: str, endpoint: str, run_id: str, n: int = 2, **conf: Any) -> list[Any]:
    return [get_rendezvous_handler(params(backend, endpoint, run_id, n, **conf)) for _ in range(n)]


def rendezvous(hs: list[Any], timeout: float = 40) -> list[Any]:
    with ThreadPoolExecutor(len(hs)) as pool:
        return [f.result(timeout=timeout) for f in [pool.submit(h.next_rendezvous) for h in hs]]


def shutdown(hs: list[Any]) -> None:
    for h in hs:
        h.shutdown()


def test_parse_endpoints() -> None:
    assert parse_endpoints("h1:1,h2") == [("h1", 1), ("h2", 2379)]
    assert parse_endpoints("http://h:5/,[::1]:7") == [("h", 5), ("::1", 7)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unreachable_is_one_line_error(backend: str) -> None:
    from elastic.testing.etcd import free_port

    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as err:
        get_rendezvous_handler(
            params(backend, f"127.0.0.1:{free_port()}", "r", retry_timeout="1.5")
        )
    assert time.monotonic() - started < 10
    message = str(err.value)
    assert "cannot reach etcd at http://127.0.0.1:" in message and "\n" not in message


@pytest.mark.parametrize("backend", ROUND_UNDER_ETCD)
def test_etcd_restart_mid_rendezvous_and_mid_run(backend: str, etcd_server: EtcdCluster) -> None:
    # Heartbeat TTLs must outlast the etcd outage (TTLs keep running while it is down).
    hs = handlers(backend, etcd_server.endpoint, "restart", 2, keep_alive_max_attempt=12)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(hs[0].next_rendezvous)
        time.sleep(0.5)  # node 0 is waiting for node 1
        etcd_server.restart(down_for=0.5)
        second = pool.submit(hs[1].next_rendezvous)
        infos = [first.result(timeout=40), second.result(timeout=40)]
    assert sorted(i.rank for i in infos) == [0, 1]
    assert infos[0].store.add("agent/restarts", 1) == 1
    etcd_server.restart(down_for=1.0)  # mid-run: heartbeats and the store carry on
    assert infos[1].store.add("agent/restarts", 1) == 2
    time.sleep(2.5)  # longer than the heartbeat TTL
    assert hs[0].lost_nodes() == [] and hs[1].lost_nodes() == []
    again = rendezvous(hs)
    assert sorted(i.rank for i in again) == [0, 1]
    shutdown(hs)


@pytest.mark.parametrize("backend", ROUND_UNDER_ETCD)
def test_one_member_of_three_killed(backend: str, etcd_cluster: EtcdCluster) -> None:
    hs = handlers(backend, etcd_cluster.endpoint, "cluster", 2)
    infos = rendezvous(hs)
    etcd_cluster.members[0].kill()  # the member every client talks to first
    assert infos[0].store.add("agent/restarts", 5) == 5
    assert infos[1].store.compare_set("agent/restart_claim/0", "", "x") == b"x"
    again = rendezvous(hs)
    assert sorted(i.rank for i in again) == [0, 1]
    time.sleep(2.5)
    assert hs[0].lost_nodes() == []
    shutdown(hs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tls(backend: str, etcd_tls: EtcdCluster) -> None:
    tls = etcd_tls.members[0].tls
    assert tls is not None
    ca, cert, key = TLS_KEYS[backend]
    good = {"protocol": "https", ca: tls.ca_cert, cert: tls.client_cert, key: tls.client_key}
    hs = handlers(backend, etcd_tls.endpoint, "tls", 2, **good)
    assert sorted(i.rank for i in rendezvous(hs)) == [0, 1]
    shutdown(hs)
    wrong = {**good, ca: tls.other_ca_cert}
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as err:
        get_rendezvous_handler(params(backend, etcd_tls.endpoint, "tls", **wrong))
    assert "TLS" in str(err.value) and "\n" not in str(err.value)
    assert time.monotonic() - started < 5  # not retried: a wrong CA does not heal
    with pytest.raises(RendezvousConnectionError):  # no client certificate at all
        get_rendezvous_handler(params(backend, etcd_tls.endpoint, "tls", protocol="https",
                                      **{ca: tls.ca_cert}, retry_timeout="2"))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_password(backend: str, etcd_server: EtcdCluster) -> None:
    from elastic.testing.etcd import enable_v2_auth

    enable_v2_auth(etcd_server.members[0], "root", "s3cret")
    # One node: etcd checks the password (bcrypt) on every request, which is slow here.
    hs = handlers(backend, etcd_server.endpoint, "auth", 1, username="root", password="s3cret")
    assert [i.rank for i in rendezvous(hs)] == [0]
    shutdown(hs)
    for bad in ({"username": "root", "password": "nope"}, {}):
        with pytest.raises(RendezvousConnectionError) as err:
            get_rendezvous_handler(params(backend, etcd_server.endpoint, "auth", **bad))
        assert "refused" in str(err.value) and "username/password" in str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_state_names_key(backend: str, etcd_server_shared: EtcdCluster) -> None:
    run = f"corrupt-{backend}"
    h = get_rendezvous_handler(params(backend, etcd_server_shared.endpoint, run, 1))
    h.rdzv_store.set("round", "{not json")
    with pytest.raises(RendezvousStateError, match=f"{PREFIX[backend]}/{run}/rdzv/round"):
        h.next_rendezvous()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fingerprint_mismatch(backend: str, etcd_server_shared: EtcdCluster) -> None:
    run = f"fp-{backend}"
    a = params(backend, etcd_server_shared.endpoint, run, 1)
    a.fingerprint = {"torch": "2.13.0", "python": "3.11"}
    first = get_rendezvous_handler(a)
    first.next_rendezvous()
    b = params(backend, etcd_server_shared.endpoint, run, 1)
    b.fingerprint = {"torch": "2.12.0", "python": "3.11"}
    with pytest.raises(RendezvousMismatchError) as err:
        get_rendezvous_handler(b).next_rendezvous()
    assert "torch" in err.value.fields
    first.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_describe_is_read_only(backend: str, etcd_server_shared: EtcdCluster) -> None:
    run = f"desc-{backend}"
    hs = handlers(backend, etcd_server_shared.endpoint, run, 2)
    infos = rendezvous(hs)
    claim_restart(infos[0].store, 0, "a")
    claim_restart(infos[0].store, 1, "a")
    viewer_params = params(backend, etcd_server_shared.endpoint, run, 2)
    viewer_params.read_only = True
    status = get_rendezvous_handler(viewer_params).describe()
    assert status.backend == backend  # the user's name for it, in `elastic status`
    assert status.state == "running" and status.round == infos[0].round
    assert [m.node_id for m in status.members] == by_rank(infos)
    assert status.restarts_used == 2 and status.waiting == 0
    hs[0].set_closed()
    assert get_rendezvous_handler(viewer_params).describe().state == "closed"
    shutdown(hs)


def test_etcd_keys_map_onto_the_round(etcd_server_shared: EtcdCluster) -> None:
    """torch's ``etcd`` keys are the round's settings under torch's names; the old
    protocol's ``keep_alive_ttl`` is one line naming what to use instead."""
    endpoint = etcd_server_shared.endpoint
    h = get_rendezvous_handler(params("etcd", endpoint, "keys", 1, timeout=33))
    assert h.settings.join_timeout == 33.0 and h.settings.last_call_timeout == 1.0
    assert h.settings.heartbeat_timeout == 2.0  # keep_alive_interval * keep_alive_max_attempt
    h.shutdown()
    with pytest.raises(RendezvousConfigError) as err:
        get_rendezvous_handler(params("etcd", endpoint, "keys", 1, keep_alive_ttl=2))
    message = str(err.value)
    assert "keep_alive_ttl=2" in message and "heartbeat_timeout" in message
    assert "\n" not in message
    for bad, names in (
        ({"join_timeout": 5}, ("timeout", "join_timeout")),  # one setting, two names
        ({"timeout": 0}, ("timeout=0",)),  # the error names what the user wrote
        ({"key_prefix": "/x"}, ("key_prefix", "etcd_prefix")),  # etcd-v2's spelling
    ):
        with pytest.raises(RendezvousConfigError) as err:
            get_rendezvous_handler(params("etcd", endpoint, "keys", 1, **bad))
        assert all(name in str(err.value) for name in names), err.value


def test_etcd_prefix_places_the_job(etcd_server_shared: EtcdCluster) -> None:
    """``etcd_prefix`` (torch's) roots the job; the two backends' defaults differ, so one
    job id under both never shares state."""
    client = etcd.Client(port=etcd_server_shared.members[0].client_port)
    endpoint = etcd_server_shared.endpoint
    mine = handlers("etcd", endpoint, "prefixed", 1, etcd_prefix="/torchelastic/p2p")
    rendezvous(mine)
    assert client.read("/torchelastic/p2p/prefixed").dir
    with pytest.raises(etcd.EtcdKeyNotFound):
        client.read("/elastic/etcd/prefixed")
    both = [*handlers("etcd", endpoint, "same-id", 1), *handlers("etcd-v2", endpoint, "same-id", 1)]
    infos = rendezvous(both)  # each alone in its own job
    assert [i.world_size for i in infos] == [1, 1]
    assert client.read("/elastic/etcd/same-id").dir and client.read("/elastic/rdzv/same-id").dir
    shutdown(mine + both)


def test_shutdown_is_not_a_lost_node(etcd_server_shared: EtcdCluster) -> None:
    for backend in BACKENDS:
        hs = handlers(backend, etcd_server_shared.endpoint, f"bye-{backend}", 2)
        rendezvous(hs)
        hs[1].set_closed()  # the job finished: shutting down now is done, not lost
        hs[1].shutdown()
        time.sleep(3)  # past the heartbeat TTL
        assert hs[0].lost_nodes() == [], backend
        hs[0].shutdown()


def test_lost_nodes_is_cheap(etcd_server_shared: EtcdCluster) -> None:
    """The agent polls lost_nodes often: it must answer from a cache, not from etcd."""
    hs = handlers("etcd-v2", etcd_server_shared.endpoint, "cheap", 2)
    rendezvous(hs)
    started = time.monotonic()
    for _ in range(1000):
        hs[0].lost_nodes()
        hs[0].num_nodes_waiting()
    assert time.monotonic() - started < 0.5
    shutdown(hs)
    assert threading.active_count() < 200


# -- end to end: real agents (python -m elastic run) over etcd ----------------------------
TRAIN = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"RESULT rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
      f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} sum={int(t.item())}", flush=True)
dist.destroy_process_group()
while not os.path.exists(os.environ["STOP_FILE"]):
    time.sleep(0.1)
"""
E2E_CONF = {
    "etcd-v2": "last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=4",
    "etcd": "last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=4",
}


def start_agent(tmp_path: Any, backend: str, endpoint: str, nnodes: str) -> Any:
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = dict(os.environ, PYTHONUNBUFFERED="1", STOP_FILE=str(tmp_path / "stop"))
    cmd = [sys.executable, "-m", "elastic", "run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", "--rdzv-id=e2e",
           f"--rdzv-conf={E2E_CONF[backend]}", "--monitor-interval=0.1", str(script)]  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


class Output:
    """A process's output, collected by one reader thread as it runs."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def read_until(self, needle: str, timeout: float, start: int = 0) -> int:
        """Index of the first line from ``start`` containing ``needle``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(start, len(self.lines)):
                if needle in self.lines[i]:
                    return i
            time.sleep(0.1)
        text = "".join(self.lines)[-3000:]
        raise AssertionError(f"no {needle!r} within {timeout}s:\n{text}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_e2e_two_agents_gloo_all_reduce(backend: str, etcd_server: EtcdCluster, tmp_path) -> None:  # noqa: ANN001
    import os
    import signal

    agents = [start_agent(tmp_path, backend, etcd_server.endpoint, "2") for _ in range(2)]
    try:
        outs = [Output(a) for a in agents]
        lines = [o.lines[o.read_until("RESULT", 30)] for o in outs]
        assert all("world=2" in line and "sum=3" in line for line in lines), lines
        (tmp_path / "stop").touch()
        for agent in agents:
            assert agent.wait(timeout=20) == 0
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=10)


@pytest.mark.slow
def test_e2e_killed_agent_is_noticed(etcd_server: EtcdCluster, tmp_path) -> None:  # noqa: ANN001
    """SIGKILL one of two agents (min 1): the survivor learns it from the heartbeat TTL,
    stops its workers and continues alone in a new round."""
    import os
    import signal

    agents = [start_agent(tmp_path, "etcd-v2", etcd_server.endpoint, "1:2") for _ in range(2)]
    try:
        outs = [Output(a) for a in agents]
        first = [o.read_until("world=2", 30) for o in outs]
        os.killpg(agents[1].pid, signal.SIGKILL)
        agents[1].wait(timeout=10)
        i = outs[0].read_until("world=1", 20, start=first[0])  # re-formed alone
        assert "sum=1" in outs[0].lines[i]
        (tmp_path / "stop").touch()
        assert agents[0].wait(timeout=20) == 0
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=10)
