"""The backend contract (``elastic.testing.conformance``) run against etcd, etcd-v2 and c10d,
each on real servers on free loopback ports."""

from __future__ import annotations

import importlib.util
import socket
from typing import TYPE_CHECKING

import pytest
from elastic.testing.conformance import RendezvousConformance, RendezvousTarget

if TYPE_CHECKING:
    from elastic.testing.etcd import EtcdCluster

# Registered as a plugin (not imported) so pytest can rewrite its asserts.
pytest_plugins = ["elastic.testing.etcd"]

QUICK_ETCD_V2 = {
    "last_call_timeout": "1",
    "keep_alive_interval": "0.5",
    "keep_alive_max_attempt": "4",  # heartbeat TTL 2 s
    "join_timeout": "60",
}
QUICK_ETCD = {"last_call_timeout": "1", "keep_alive_ttl": "2", "timeout": "60"}
QUICK_C10D = {
    "last_call_timeout": "1",
    "heartbeat_interval": "0.5",
    "heartbeat_timeout": "3",
    "close_timeout": "2",
    "join_timeout": "60",
}


class TestEtcdV2Conformance(RendezvousConformance):
    @pytest.fixture
    def rdzv_target(self, etcd_server_shared: EtcdCluster) -> RendezvousTarget:
        return RendezvousTarget("etcd-v2", etcd_server_shared.endpoint, dict(QUICK_ETCD_V2))


class TestEtcdConformance(RendezvousConformance):
    @pytest.fixture
    def rdzv_target(self, etcd_server_shared: EtcdCluster) -> RendezvousTarget:
        return RendezvousTarget("etcd", etcd_server_shared.endpoint, dict(QUICK_ETCD))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(
    importlib.util.find_spec("elastic.plugins.rdzv_c10d.handler") is None,
    reason="the c10d backend has not landed",
)
class TestC10dConformance(RendezvousConformance):
    @pytest.fixture
    def rdzv_target(self) -> RendezvousTarget:
        # The first handler created hosts the store, since the endpoint host is local.
        return RendezvousTarget("c10d", f"127.0.0.1:{_free_port()}", dict(QUICK_C10D))
