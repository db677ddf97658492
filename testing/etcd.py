"""Real etcd servers for tests: one member, a three-member cluster, a TLS member.

Each server listens on free loopback ports with a temporary data directory, serves the v2
API (``--enable-v2``: both etcd backends speak v2), is healthy before a fixture yields it
and is SIGKILLed and reaped at teardown. Use from a test module with::

    pytest_plugins = ["elastic.testing.etcd"]

and the fixtures ``etcd_server`` (per test), ``etcd_server_shared`` (per module; isolate
tests with distinct run ids), ``etcd_cluster`` (three members) and ``etcd_tls`` (a member
that requires client certificates signed by a CA generated for the test).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ETCD_BINARY = os.environ.get("ELASTIC_TEST_ETCD", shutil.which("etcd") or "/usr/bin/etcd")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
            "--enable-v2",
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
        return cmd

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

    def healthy(self) -> bool:
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=self.tls.ca_cert)
            ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1, context=ctx) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False


class EtcdCluster:
    """One or more members started together; ``endpoint`` lists them all."""

    def __init__(self, size: int = 1, tls: TlsFiles | None = None, root: Path | None = None):
        self.root = root or Path(tempfile.mkdtemp(prefix="elastic-etcd-"))
        self.members = [
            EtcdMember(name=f"m{i}", data_dir=self.root / f"m{i}.etcd", tls=tls)
            for i in range(size)
        ]
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 20.0) -> EtcdCluster:
        for member in self.members:
            member.start(self.initial_cluster)
        self.wait_healthy(timeout)
        return self

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


EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")  # fast to generate


def make_tls_files(directory: Path) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a second CA."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    directory.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        subj = f"/CN=elastic-test-{ca}"
        run("req", "-x509", *EC_KEY, "-nodes", "-days", "2",
            "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-subj", subj)  # fmt: skip
    ext = directory / "san.cnf"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    for who in ("server", "client"):
        run("req", *EC_KEY, "-nodes", "-keyout", f"{who}.key",
            "-out", f"{who}.csr", "-subj", f"/CN={who}")  # fmt: skip
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{who}.crt",
            "-extfile", str(ext))  # fmt: skip
    d = str(directory)
    return TlsFiles(
        ca_cert=f"{d}/ca.crt",
        server_cert=f"{d}/server.crt",
        server_key=f"{d}/server.key",
        client_cert=f"{d}/client.crt",
        client_key=f"{d}/client.key",
        other_ca_cert=f"{d}/other-ca.crt",
    )


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
