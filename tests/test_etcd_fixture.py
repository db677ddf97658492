"""The etcd the tests start: a port taken between its choice and etcd's bind is chosen
again, so a busy machine's race is no test's error."""

from __future__ import annotations

import socket

import pytest
from elastic.testing.etcd import EtcdCluster


@pytest.mark.timeout(120)
def test_a_cluster_whose_ports_were_taken_starts_on_new_ones() -> None:
    cluster = EtcdCluster(1)
    member = cluster.members[0]
    taken = member.client_port
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    try:
        cluster.start()
        assert member.client_port != taken
        assert member.healthy()
        assert "address already in use" not in cluster.tail(member)
    finally:
        squatter.close()
        cluster.stop()


@pytest.mark.timeout(120)
def test_an_etcd_that_fails_otherwise_is_still_an_error() -> None:
    cluster = EtcdCluster(1, extra_args=("--no-such-flag",))
    try:
        with pytest.raises(RuntimeError, match="exited"):
            cluster.start()
    finally:
        cluster.stop()
