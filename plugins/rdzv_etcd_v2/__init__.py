"""The ``etcd-v2`` rendezvous backend: our c10d membership rules over etcd's v2 API.

Per-node join records (etcd in-order keys, so joining never contends), one published
assignment per round (created with ``prevExist=false``: exactly one writer wins), TTL'd
heartbeats whose expiry wakes every survivor through a watch. State is JSON; nothing read
from etcd is ever unpickled. Layout under ``<key_prefix>/<run_id>``::

    closed                    present once the job is finished
    fingerprint               the job's fingerprint (first node writes it)
    open_round                the round nodes join now (an int)
    rounds/<r>/joins/<seq>    one join record per node (TTL, refreshed while waiting)
    rounds/<r>/assignment     the formed round: members by rank, master addr/port
    rounds/<r>/alive/<node>   members' heartbeats (TTL, refreshed)
    store/                    the job store (``RendezvousInfo.store``)

``--rdzv-conf`` keys: protocol, ca_cert, ssl_cert, ssl_cert_key, username, password,
key_prefix, join_timeout, last_call_timeout, keep_alive_interval, keep_alive_max_attempt,
read_timeout, retry_timeout.
"""

from __future__ import annotations

from elastic.core.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.plugins.rdzv_etcd.client import CONNECTION_KEYS, check_reachable, client_from_params
from elastic.plugins.rdzv_etcd_v2.handler import EtcdV2RendezvousHandler, Settings

ACCEPTED_KEYS = (
    *CONNECTION_KEYS,
    "ca_cert",
    "ssl_cert",
    "ssl_cert_key",
    "key_prefix",
    "join_timeout",
    "last_call_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    params.check_keys(ACCEPTED_KEYS)
    settings = Settings.from_params(params)
    client = client_from_params(
        params, ca_key="ca_cert", cert_key="ssl_cert", key_key="ssl_cert_key"
    )
    check_reachable(client)
    return EtcdV2RendezvousHandler(params, client, settings)


__all__ = ["ACCEPTED_KEYS", "EtcdV2RendezvousHandler", "create_handler"]
