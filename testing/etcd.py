"""Real etcd servers for tests: one member, a three-member cluster, a TLS member.

Each server listens on free loopback ports with a temporary data directory, serves the v2
API (``--enable-v2``, which the ``etcd`` and ``etcd-v2`` backends speak) unless made with
``v2=False``, is healthy before a fixture yields it and is SIGKILLed and reaped at
teardown. Use from a test module with::

    pytest_plugins = ["elastic.testing.etcd"]

and the fixtures ``etcd_server`` (per test), ``etcd_server_shared`` (per module; isolate
tests with distinct run ids), ``etcd_cluster`` (three members) and ``etcd_tls`` (a member
that requires client certificates signed by a CA generated for the test).

v3 only (no v2 API, as etcd 3.4 serves by default): ``etcd_v3_server``,
``etcd_v3_server_shared``, ``etcd_v3_cluster`` and ``etcd_v3_tls_auth`` (client
certificates plus v3 authentication: user ``root``, password ``secret``, tokens that expire
after ``V3_TOKEN_TTL`` idle seconds). ``gateway_post`` calls a member's JSON gateway.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from elastic.testing.ports import free_port

# Starts of a new cluster, each on newly chosen ports, before a taken port is an error.
PORT_ATTEMPTS = 3
ETCD_BINARY = os.environ.get("ELASTIC_TEST_ETCD", shutil.which("etcd") or "/usr/bin/etcd")


@dataclass
class TlsFiles:
    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_cert: str  # a CA that signed nothing here: "the wrong CA"


@dataclass
class EtcdMember:
    name: str
    data_dir: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    tls: TlsFiles | None = None
    v2: bool = True  # serve the v2 API (--enable-v2)
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def command(self, initial_cluster: str, state: str = "new") -> list[str]:
        # Every member of one cluster must share the token; the peer list is unique enough.
        token = f"elastic-{abs(hash(initial_cluster)) % 10**8}"
        cmd = [
            ETCD_BINARY,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            *(["--enable-v2"] if self.v2 else []),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", token,
            # Fast elections: tests kill members and want a new leader within a second.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.tls:
            cmd += [
                "--cert-file", self.tls.server_cert,
                "--key-file", self.tls.server_key,
                "--trusted-ca-file", self.tls.ca_cert,
                "--client-cert-auth",
            ]  # fmt: skip
        return cmd + list(self.extra_args)

    def start(self, initial_cluster: str) -> None:
        self.log = self.data_dir.parent / f"{self.name}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(initial_cluster),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL and reap (an abrupt crash, as a member restart or a lost machine)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context trusting the test CA and presenting the client certificate."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.ca_cert)
        ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        return ctx

    def healthy(self) -> bool:
        ctx = self.ssl_context()
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1, context=ctx) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False


class EtcdCluster:
    """One or more members started together; ``endpoint`` lists them all."""

    def __init__(
        self,
        size: int = 1,
        tls: TlsFiles | None = None,
        root: Path | None = None,
        v2: bool = True,
        extra_args: tuple[str, ...] = (),
    ):
        self.root = root or Path(tempfile.mkdtemp(prefix="elastic-etcd-"))
        self.members = [
            EtcdMember(
                name=f"m{i}",
                data_dir=self.root / f"m{i}.etcd",
                tls=tls,
                v2=v2,
                extra_args=extra_args,
            )
            for i in range(size)
        ]

    @property
    def initial_cluster(self) -> str:
        """Every member's peer address, as etcd's ``--initial-cluster`` takes them."""
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 20.0) -> EtcdCluster:
        """Start every member. A port taken between its choice and etcd's bind (by another
        test's process, or an outgoing connection's) is chosen again: the cluster is new,
        so its members can all move."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            for member in self.members:
                member.start(self.initial_cluster)
            try:
                self.wait_healthy(timeout)
                return self
            except RuntimeError:
                if attempt == PORT_ATTEMPTS or not self._port_taken():
                    raise
                self._move()
        raise AssertionError("unreachable")

    def _port_taken(self) -> bool:
        """Whether a member gave up because its port was someone else's by then."""
        return any(
            m.log is not None and m.log.exists() and b"address already in use" in m.log.read_bytes()
            for m in self.members
        )

    def _move(self) -> None:
        """Every member stopped, its data and log gone, on new ports."""
        for member in self.members:
            member.kill()
            shutil.rmtree(member.data_dir, ignore_errors=True)
            if member.log is not None:
                member.log.unlink(missing_ok=True)
            member.client_port, member.peer_port = free_port(), free_port()

    def wait_healthy(self, timeout: float = 20.0, members: list[EtcdMember] | None = None) -> None:
        deadline = time.monotonic() + timeout
        for member in members or self.members:
            while not member.healthy():
                if member.proc is not None and member.proc.poll() is not None:
                    raise RuntimeError(f"etcd {member.name} exited: {self.tail(member)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {member.name} not healthy: {self.tail(member)}")
                time.sleep(0.05)

    def restart(self, member: EtcdMember | None = None, down_for: float = 0.0) -> None:
        """SIGKILL a member and start it again on the same ports and data."""
        member = member or self.members[0]
        member.kill()
        time.sleep(down_for)
        member.start(self.initial_cluster)
        self.wait_healthy(members=[member])

    @staticmethod
    def tail(member: EtcdMember) -> str:
        if member.log is None or not member.log.exists():
            return ""
        return member.log.read_text(errors="replace")[-1500:]

    def stop(self) -> None:
        for member in self.members:
            member.kill()
        shutil.rmtree(self.root, ignore_errors=True)


def enable_v2_auth(member: EtcdMember, user: str = "root", password: str = "secret") -> None:
    """Turn on etcd's v2 authentication (separate from v3 auth in etcd 3.4) with one root
    user, and take the guest role's rights away so anonymous requests are refused."""
    import base64

    def call(method: str, path: str, body: dict[str, object] | None, auth: bool) -> None:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(member.client_url + path, data=data, method=method)
        if auth:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(req, timeout=5):
            pass

    call("PUT", f"/v2/auth/users/{user}", {"user": user, "password": password}, False)
    call("PUT", "/v2/auth/enable", None, False)
    revoke = {"kv": {"read": ["/*"], "write": ["/*"]}}
    call("PUT", "/v2/auth/roles/guest", {"role": "guest", "revoke": revoke}, True)


def gateway_post(
    member: EtcdMember, path: str, body: dict[str, Any], token: str | None = None
) -> dict[str, Any]:
    """POST JSON to a member's v3 gateway (``/v3/<path>``); raises ``HTTPError`` on non-200."""
    req = urllib.request.Request(
        f"{member.client_url}/v3/{path}", data=json.dumps(body).encode(), method="POST"
    )
    if token:
        req.add_header("Authorization", token)
    with urllib.request.urlopen(req, timeout=5, context=member.ssl_context()) as r:
        return dict(json.loads(r.read()))


def enable_v3_auth(member: EtcdMember, user: str = "root", password: str = "secret") -> None:
    """Turn on etcd's v3 authentication with one user holding the root role (what
    ``etcdctl user add root && etcdctl auth enable`` do), through the gateway."""
    gateway_post(member, "auth/user/add", {"name": user, "password": password})
    gateway_post(member, "auth/user/grant", {"user": user, "role": "root"})
    gateway_post(member, "auth/enable", {})


V3_TOKEN_TTL = 2  # seconds an idle v3 auth token lives on etcd_v3_tls_auth (etcd: 300)


EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")  # fast to generate


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def make_tls_files(directory: Path, client_subject: str = "/CN=client") -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a second CA."""
    directory.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        subj = f"/CN=elastic-test-{ca}"
        _openssl(directory, "req", "-x509", *EC_KEY, "-nodes", "-days", "2",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-subj", subj)  # fmt: skip
    (directory / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    server_cert, server_key = sign_cert(directory, "server", "/CN=server")
    client_cert, client_key = sign_cert(directory, "client", client_subject)
    return TlsFiles(
        ca_cert=str(directory / "ca.crt"),
        server_cert=server_cert,
        server_key=server_key,
        client_cert=client_cert,
        client_key=client_key,
        other_ca_cert=str(directory / "other-ca.crt"),
    )


def sign_cert(directory: Path, name: str, subject: str) -> tuple[str, str]:
    """A certificate and key ``<name>.crt``/``<name>.key`` for ``subject``, signed by the
    CA ``make_tls_files`` made in ``directory``."""
    _openssl(directory, "req", *EC_KEY, "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", subject)  # fmt: skip
    _openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt",
             "-CAkey", "ca.key", "-CAcreateserial", "-days", "2", "-out", f"{name}.crt",
             "-extfile", "san.cnf")  # fmt: skip
    return str(directory / f"{name}.crt"), str(directory / f"{name}.key")


def _serve(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_server() -> Iterator[EtcdCluster]:
    """A fresh single-member etcd for one test (restart it with ``.restart()``)."""
    yield from _serve(EtcdCluster(1))


@pytest.fixture(scope="module")
def etcd_server_shared() -> Iterator[EtcdCluster]:
    """One single-member etcd shared by a module's tests (use distinct run ids)."""
    yield from _serve(EtcdCluster(1))


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A three-member etcd cluster; ``.endpoint`` lists every member."""
    yield from _serve(EtcdCluster(3))


@pytest.fixture
def etcd_tls(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A member requiring client certificates; ``.members[0].tls`` has the files."""
    tls = make_tls_files(tmp_path / "tls")
    yield from _serve(EtcdCluster(1, tls=tls))


@pytest.fixture
def etcd_v3_server() -> Iterator[EtcdCluster]:
    """A fresh single-member etcd serving only the v3 API."""
    yield from _serve(EtcdCluster(1, v2=False))


@pytest.fixture(scope="module")
def etcd_v3_server_shared() -> Iterator[EtcdCluster]:
    """One v3-only member shared by a module's tests (use distinct key prefixes)."""
    yield from _serve(EtcdCluster(1, v2=False))


@pytest.fixture
def etcd_v3_cluster() -> Iterator[EtcdCluster]:
    """A three-member v3-only cluster; ``.endpoint`` lists every member."""
    yield from _serve(EtcdCluster(3, v2=False))


@pytest.fixture
def etcd_v3_tls_auth(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A v3-only member requiring client certificates and v3 authentication (user
    ``root``, password ``secret``; idle tokens expire after ``V3_TOKEN_TTL`` seconds).
    ``sign_cert(Path(tls.ca_cert).parent, ...)`` makes other certificates from its CA."""
    # With v3 auth on, etcd's gateway refuses client certificates that carry a CommonName
    # (it cannot map one to a user): the client certificate here has none.
    tls = make_tls_files(tmp_path / "tls", client_subject="/O=elastic-test")
    ttl = ("--auth-token-ttl", str(V3_TOKEN_TTL))
    cluster = EtcdCluster(1, tls=tls, v2=False, extra_args=ttl)
    try:
        cluster.start()
        enable_v3_auth(cluster.members[0])
        yield cluster
    finally:
        cluster.stop()
