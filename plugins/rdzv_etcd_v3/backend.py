"""The ``etcd-v3`` rendezvous backend: the shared round over etcd's v3 API.

Every membership rule is the shared round's (``elastic.core.rendezvous.round``); this module only
connects. Liveness rides on a lease per connection (a crashed node's heartbeat key goes
away by itself), ``compare_set`` and ``add`` are transactions, ``wait`` is a watch. It
needs neither etcd's v2 API (off by default in 3.4/3.5, removed in 3.6) nor gRPC.

``--rdzv-conf`` keys: the round's (``elastic.core.rendezvous.round.settings``), ``key_prefix``
(default ``/elastic/rdzv-v3``) and the connection keys of ``store.CONNECTION_KEYS``.
"""

from __future__ import annotations

from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.core.plugin.extras import needs_extra
from elastic.core.rendezvous import net
from elastic.core.rendezvous.hedging import member_timing
from elastic.core.rendezvous.round.handler import open_round_handler
from elastic.core.rendezvous.round.settings import parse_round_settings

# The client (imported when a handler is made) speaks etcd through urllib3: checked
# here, so a missing extra fails the backend's load, as for the other backends.
with needs_extra("the etcd-v3 rendezvous backend"):
    import urllib3  # noqa: F401

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
    # The monitor thread's and the keep-alives' connections give a member ``attempt`` s;
    # all three hedge (a member that hangs holds up neither a lease nor a round).
    attempt, hedge = member_timing(settings.heartbeat_timeout)

    def reach(job_store: CoordinationStore) -> str:
        job_store.check(["rdzv/round"])  # one line now if etcd cannot be reached
        host, port = parse_endpoints(params.endpoint or "127.0.0.1")[0]
        return params.local_addr or net.route_address(host, port)

    return open_round_handler(
        params,
        settings,
        "etcd-v3",
        lambda: store_from_params(params, prefix, ttl, hedge_after=hedge),
        reach,
        lambda: store_from_params(params, prefix, ttl, attempt, hedge),
    )
