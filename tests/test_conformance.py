"""The backend contract (``elastic.testing.conformance``) run against every built-in backend
(c10d, etcd-v3, etcd-v2, etcd and static), each on real servers on free
loopback ports; the cases that do not apply to a backend are skipped by name."""

from __future__ import annotations

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
QUICK_ETCD = {  # torch's etcd keys on the shared round: ``timeout`` is join_timeout
    "last_call_timeout": "1",
    "keep_alive_interval": "0.5",
    "keep_alive_max_attempt": "4",
    "timeout": "60",
}
QUICK_C10D = {
    "last_call_timeout": "1",
    "heartbeat_interval": "0.5",
    "heartbeat_timeout": "3",
    "close_timeout": "2",
    "join_timeout": "60",
}


# A fixed set of nodes, each told its rank, node 0 hosting the store: no membership.
STATIC_FIXED = frozenset(
    {
        "test_min_max_last_call",
        "test_scale_up_num_nodes_waiting",
        "test_lost_node_detected",
        "test_run_id_isolation",  # one node 0 per port
        "test_closed_rendezvous",  # no late joiners: the node set is fixed
        "test_mismatched_fingerprint_is_refused",
        "test_a_closed_job_says_so_before_refusing_a_mismatch",
        "test_stable_ranks_when_the_same_nodes_regroup",
        "test_regroup_after_a_departure_skips_the_last_call",
        "test_departure_is_not_completion",
        "test_describe_of_an_unknown_job_is_an_error",
    }
)


class TestEtcdV3Conformance(RendezvousConformance):
    @pytest.fixture
    def rdzv_target(self, etcd_v3_server_shared: EtcdCluster) -> RendezvousTarget:
        return RendezvousTarget("etcd-v3", etcd_v3_server_shared.endpoint, dict(QUICK_C10D))


class TestEtcdV2Conformance(RendezvousConformance):
    @pytest.fixture
    def rdzv_target(self, etcd_server_shared: EtcdCluster) -> RendezvousTarget:
        return RendezvousTarget("etcd-v2", etcd_server_shared.endpoint, dict(QUICK_ETCD_V2))


class TestEtcdConformance(RendezvousConformance):
    @pytest.fixture
    def rdzv_target(self, etcd_server_shared: EtcdCluster) -> RendezvousTarget:
        return RendezvousTarget(
            "etcd",
            etcd_server_shared.endpoint,
            dict(QUICK_ETCD),
            # The round's checks; torch's name for join_timeout is named as written.
            bad_config=(
                {"timeout": "0"},
                {"join_timeout": "0"},
                {"last_call_timeout": "-1"},
                {"heartbeat_interval": "0"},
                {"heartbeat_timeout": "nan"},
            ),
        )


class TestStaticConformance(RendezvousConformance):
    @pytest.fixture
    def rdzv_target(self) -> RendezvousTarget:
        return RendezvousTarget(
            "static",
            f"127.0.0.1:{_free_port()}",
            {"timeout": "30", "shutdown_timeout": "2"},
            node_ranks=True,
            not_applicable=STATIC_FIXED,
            bad_config=({"timeout": "0"}, {"shutdown_timeout": "-1"}),
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TestC10dConformance(RendezvousConformance):
    @pytest.fixture
    def rdzv_target(self) -> RendezvousTarget:
        # The first handler created hosts the store, since the endpoint host is local.
        return RendezvousTarget("c10d", f"127.0.0.1:{_free_port()}", dict(QUICK_C10D))
