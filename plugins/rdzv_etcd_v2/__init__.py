"""The ``etcd-v2`` rendezvous backend: the shared round over etcd's v2 API.

Every membership rule is the shared round's (``elastic.core.rendezvous.round``); this backend only
connects. Its store keeps each key as one flat entry (base64url-encoded) in the job's
directory ``<key_prefix>/<run_id>/``; heartbeats carry a TTL so a dead node's key goes
away by itself; ``compare_set`` and ``add`` are etcd test-and-set writes; ``wait`` is a
watch. State is JSON; nothing read from etcd is ever unpickled.

etcd 3.4/3.5 serve the v2 API only with ``--enable-v2``, and etcd 3.6 removed it: prefer
the ``etcd-v3`` backend, which needs neither.

``--rdzv-conf`` keys: the round's (``elastic.core.rendezvous.round.settings``) and ``ETCD_V2_KEYS``.
"""

from __future__ import annotations

import math

from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.core.rendezvous import net
from elastic.core.rendezvous.round.handler import RoundRendezvousHandler
from elastic.core.rendezvous.round.settings import parse_round_settings
from elastic.plugins.rdzv_etcd.client import CONNECTION_KEYS, check_reachable, client_from_params
from elastic.plugins.rdzv_etcd.store import EtcdStore

DEFAULT_PREFIX = "/elastic/rdzv"
ETCD_V2_KEYS = (*CONNECTION_KEYS, "ca_cert", "ssl_cert", "ssl_cert_key", "key_prefix")


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    settings = parse_round_settings(params, ETCD_V2_KEYS)
    prefix = "/" + (params.get("key_prefix", DEFAULT_PREFIX) or "").strip("/")
    directory = f"{prefix}/{params.run_id}"
    ttl = math.ceil(2 * settings.heartbeat_timeout)

    def store() -> EtcdStore:
        client = client_from_params(
            params, ca_key="ca_cert", cert_key="ssl_cert", key_key="ssl_cert_key"
        )
        return EtcdStore(client, directory, heartbeat_ttl=ttl)

    job_store = store()
    check_reachable(job_store.client)
    host, port = job_store.client.members[0]
    return RoundRendezvousHandler(
        params,
        settings,
        "etcd-v2",
        job_store,
        None if params.read_only else store(),  # the monitor thread's own connection
        params.local_addr or net.route_address(host, port),
    )


__all__ = ["ETCD_V2_KEYS", "create_handler"]
