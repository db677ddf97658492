"""The job's secrets wherever they apply: a token file others may read is refused (as
ssh refuses such a key), a short token is warned about, the etcd password can come from
a file or the environment (not only the command line, which ``ps`` shows), and the
``static`` backend's store admits agents by the token while torch's clients (the
workers) are kept away from the agents' keys."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousParameters
from elastic.core.rendezvous import secrets
from elastic.core.rendezvous.secrets import read_password, read_token
from elastic.core.tcpstore import TCPStoreClient
from elastic.plugins.rdzv_static import create_handler as static_handler
from elastic.plugins.rdzv_static.handler import StaticRendezvousHandler
from elastic.testing.etcd import EtcdCluster

pytest_plugins = ["elastic.testing.etcd"]

TOKEN = b"0123456789abcdef0123456789abcdef"
ENV = (
    "ELASTIC_RDZV_TOKEN",
    "ELASTIC_RDZV_TOKEN_FILE",
    "ELASTIC_RDZV_PASSWORD",
    "ELASTIC_RDZV_PASSWORD_FILE",
)


@pytest.fixture(autouse=True)
def no_secrets_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def secret_file(tmp_path: Path, content: bytes, mode: int, name: str = "secret") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_a_token_file_others_may_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    path = secret_file(tmp_path, TOKEN, mode)
    with pytest.raises(RendezvousConfigError, match=rf"permissions 0{mode:o} are too open") as e:
        read_token(path)
    assert "chmod 600" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv("ELASTIC_RDZV_TOKEN_FILE", path)
    with pytest.raises(RendezvousConfigError, match=r"ELASTIC_RDZV_TOKEN_FILE=.*too open"):
        read_token(None)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_token_file_is_read(tmp_path: Path, mode: int) -> None:
    assert read_token(secret_file(tmp_path, TOKEN + b"\n", mode)) == TOKEN


def test_a_short_token_is_warned_about_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(secrets, "_warned_short", set())
    caplog.set_level(logging.WARNING, logger="elastic.core.rendezvous.secrets")
    path = secret_file(tmp_path, b"short", 0o600)
    for _ in range(3):
        assert read_token(path) == b"short"
    read_token(secret_file(tmp_path, TOKEN, 0o600, "long"))
    monkeypatch.setenv("ELASTIC_RDZV_TOKEN", "tiny")
    read_token(None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "is 5 bytes: a short token can be guessed" in lines[0]
    assert "ELASTIC_RDZV_TOKEN is 4 bytes" in lines[1]


def params(config: dict[str, str]) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", "127.0.0.1:2379", "job", 1, 1, config=config)


def test_the_etcd_password_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = secret_file(tmp_path, b"s3cret\n", 0o600)
    assert read_password(params({"password_file": path})) == "s3cret"
    assert read_password(params({"password": "inline"})) == "inline"
    assert read_password(params({})) is None
    with pytest.raises(RendezvousConfigError, match="password and password_file are both"):
        read_password(params({"password": "x", "password_file": path}))
    with pytest.raises(RendezvousConfigError, match="too open"):
        read_password(params({"password_file": secret_file(tmp_path, b"x", 0o644, "open")}))
    monkeypatch.setenv("ELASTIC_RDZV_PASSWORD_FILE", path)
    assert read_password(params({})) == "s3cret"
    assert read_password(params({"password": "flag"})) == "flag"  # the flag wins
    monkeypatch.setenv("ELASTIC_RDZV_PASSWORD", "env")
    with pytest.raises(RendezvousConfigError, match="both set: give the etcd password one way"):
        read_password(params({}))
    monkeypatch.delenv("ELASTIC_RDZV_PASSWORD_FILE")
    assert read_password(params({})) == "env"


@pytest.mark.timeout(120)
def test_etcd_v3_logs_in_with_a_password_file(
    etcd_v3_tls_auth: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a real etcd with v3 authentication (user root, password secret)."""
    from elastic.plugins.rdzv_etcd_v3.store import store_from_params

    member = etcd_v3_tls_auth.members[0]
    tls = member.tls
    assert tls is not None
    base = {"protocol": "https", "ca_cert": tls.ca_cert, "ssl_cert": tls.client_cert,
            "ssl_cert_key": tls.client_key, "username": "root"}  # fmt: skip
    path = secret_file(tmp_path, b"secret\n", 0o600)
    ways = [({**base, "password_file": path}, {}), (base, {"ELASTIC_RDZV_PASSWORD": "secret"})]
    for config, env in ways:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        rdzv = RendezvousParameters("etcd-v3", member.endpoint, "job", 1, 1, config=config)
        store = store_from_params(rdzv, "/secure/", lease_ttl=5)
        try:
            store.set("a", "1")
            assert store.get("a") == b"1"
        finally:
            store.close()


# --- the static backend with a token -------------------------------------------------------


@pytest.fixture
def static_job(port: int, tmp_path: Path) -> Iterator[list[StaticRendezvousHandler]]:
    path = secret_file(tmp_path, TOKEN, 0o600, "token")
    handlers = []
    for rank in range(2):
        config = {"token_file": path, "timeout": "30"}
        p = RendezvousParameters(
            "static", f"127.0.0.1:{port}", "job", 2, 2, config=config, node_rank=rank
        )
        handler = static_handler(p)
        assert isinstance(handler, StaticRendezvousHandler)
        handlers.append(handler)
    yield handlers
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.shutdown(), reversed(handlers)))


def torch_client(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10), use_libuv=True)


@pytest.mark.timeout(120)
def test_static_keeps_strangers_from_the_agents_keys(static_job: Any, port: int) -> None:
    """The workers' client (torch's) is served as a guest, away from ``<run_id>/``: a
    stranger can neither close the job nor read a round; the agents, with the token,
    coordinate as usual, and our client without the token is told it needs one."""
    with ThreadPoolExecutor(2) as pool:
        infos = [f.result(timeout=60) for f in [pool.submit(h.next_rendezvous) for h in static_job]]
    assert sorted(i.rank for i in infos) == [0, 1]
    worker = torch_client(port)
    worker.set("default_pg/0", "a worker's key")  # the workers' keys: served
    assert worker.get("default_pg/0") == b"a worker's key"
    stranger = torch_client(port)
    stranger.set("job/rdzv/closed", "true")  # dropped: no answer is expected
    with pytest.raises(Exception, match="(?i)closed|recv|connection|broken|reset"):
        stranger.add("job/rdzv/arrivals", 1)
    reader = torch_client(port)
    with pytest.raises(Exception, match="(?i)closed|recv|connection|broken|reset"):
        reader.get("job/rdzv/latest")
    assert not any(h.is_closed() for h in static_job)
    with pytest.raises(Exception, match="requires the job's token"):
        TCPStoreClient("127.0.0.1", port)
    with ThreadPoolExecutor(2) as pool:  # the next round still forms
        again = [f.result(timeout=60) for f in [pool.submit(h.next_rendezvous) for h in static_job]]
    assert {i.round for i in again} == {1}
