"""The ``etcd-v3`` rendezvous backend: the shared round over etcd's v3 API.

Every membership rule is the shared round's (``elastic.core.rendezvous.round``); this module only
connects. Liveness rides on a lease per connection (a crashed node's heartbeat key goes
away by itself), ``compare_set`` and ``add`` are transactions, ``wait`` is a watch. It
needs neither etcd's v2 API (off by default in 3.4/3.5, removed in 3.6) nor gRPC.

``--rdzv-conf`` keys: the round's (``elastic.core.rendezvous.round.settings``), ``key_prefix``
(default ``/elastic/rdzv-v3``) and the connection keys of ``store.CONNECTION_KEYS``.
"""

from __future__ import annotations

from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.core.rendezvous import net
from elastic.core.rendezvous.round.handler import RoundRendezvousHandler
from elastic.core.rendezvous.round.settings import parse_round_settings

DEFAULT_PREFIX = "/elastic/rdzv-v3"


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elastic.rendezvous`` entry point: validate the config, reach etcd."""
    from elastic.plugins.rdzv_etcd_v3.client import parse_endpoints
    from elastic.plugins.rdzv_etcd_v3.store import CONNECTION_KEYS, store_from_params

    settings = parse_round_settings(params, (*CONNECTION_KEYS, "key_prefix"))
    root = "/" + (params.get("key_prefix", DEFAULT_PREFIX) or "").strip("/")
    prefix = f"{root}/{params.run_id}/"
    # The lease only cleans up after a dead node; staleness of the heartbeat value is what
    # finds it within heartbeat_timeout, so a slow keep-alive is never mistaken for death.
    ttl = 2 * settings.heartbeat_timeout
    job_store = store_from_params(params, prefix, ttl)
    monitor_store = lease_store = None
    try:  # whatever stops us here (etcd unreachable, Ctrl-C) closes what was opened
        job_store.check(["rdzv/round"])  # reach etcd now: one line if it cannot be reached
        # The monitor thread's own store. etcd holds a write proposed just before its
        # leader died until its own request timeout (~6 s), though the new leader is
        # elected in about a second: a tick waiting that long would fence every healthy
        # node when one etcd member of three is lost. So each of its requests gives up on
        # a member after a third of heartbeat_timeout (at least 1 s) and is retried on the
        # next one.
        attempt = max(1.0, settings.heartbeat_timeout / 3)
        if not params.read_only:
            monitor_store = store_from_params(params, prefix, ttl, attempt)
            # The keep-alives' own connections and lease (``core/rendezvous/round/lease.py``).
            lease_store = store_from_params(params, prefix, ttl, attempt)
        host, port = parse_endpoints(params.endpoint or "127.0.0.1")[0]
        return RoundRendezvousHandler(
            params,
            settings,
            "etcd-v3",
            job_store,
            monitor_store,
            params.local_addr or net.route_address(host, port),
            lease_store=lease_store,
        )
    except BaseException:
        for store in (job_store, monitor_store, lease_store):
            if store is not None:
                store.close()
        raise
