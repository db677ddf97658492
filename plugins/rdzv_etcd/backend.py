"""The shared round over etcd's v2 API, for both backends that speak it: ``etcd`` (torch's
name) and ``etcd-v2``.

They differ only in what users see: the backend's name (in ``describe`` and errors), its
``--rdzv-conf`` spellings (torch's ``etcd`` backend says ``cacert``/``cert``/``key``,
``etcd_prefix`` and ``timeout``) and its default key prefix, so one job id under the two
backends never shares state. Every membership rule is the shared round's
(``elastic.core.rendezvous.round``); this module only connects, so both backends regroup,
fence and leave by the same rules as ``c10d`` and ``etcd-v3``.

The job's keys are flat entries of one etcd directory ``<prefix>/<run_id>/`` (``store``);
heartbeats carry a TTL of twice ``heartbeat_timeout`` so a dead node's key goes away by
itself, while staleness of its value is what finds it lost. etcd 3.4/3.5 serve the v2 API
only with ``--enable-v2`` and etcd 3.6 removed it: ``etcd-v3`` needs neither.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.core.rendezvous import net
from elastic.core.rendezvous.hedging import member_timing
from elastic.core.rendezvous.round.handler import open_round_handler
from elastic.core.rendezvous.round.settings import parse_round_settings
from elastic.plugins.rdzv_etcd.client import CONNECTION_KEYS, check_reachable, client_from_params
from elastic.plugins.rdzv_etcd.store import EtcdStore


@dataclass(frozen=True)
class V2Backend:
    """One backend's face on the shared v2 adapter; ``create_handler`` is its entry point."""

    name: str
    default_prefix: str
    prefix_key: str
    tls_keys: tuple[str, str, str]  # --rdzv-conf names of the CA, client cert, its key
    aliases: Mapping[str, str] = field(default_factory=dict)  # own key -> round key
    refused: Mapping[str, str] = field(default_factory=dict)  # key -> what to use instead

    def directory(self, params: RendezvousParameters) -> str:
        root = (params.get(self.prefix_key, self.default_prefix) or "").strip("/")
        return "/" + "/".join(part for part in (root, params.run_id) if part)

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        settings = parse_round_settings(
            params,
            (*CONNECTION_KEYS, *self.tls_keys, self.prefix_key),
            aliases=self.aliases,
            refused=self.refused,
        )
        directory = self.directory(params)
        ttl = math.ceil(2 * settings.heartbeat_timeout)
        ca, cert, key = self.tls_keys

        # The monitor thread's and the keep-alives' connections give a member ``attempt``
        # s; all three hedge their reads and heartbeats (a member that hangs holds up
        # neither a lease nor a round: ``hedging.member_timing``).
        attempt, hedge = member_timing(settings.heartbeat_timeout)

        def store(max_attempt: float | None = None) -> EtcdStore:
            client = client_from_params(
                params, ca_key=ca, cert_key=cert, key_key=key,
                max_attempt=max_attempt, hedge_after=hedge,
            )  # fmt: skip
            return EtcdStore(client, directory, heartbeat_ttl=ttl)

        def reach(job_store: EtcdStore) -> str:
            check_reachable(job_store.client)
            host, port = job_store.client.members[0]
            return params.local_addr or net.route_address(host, port)

        return open_round_handler(params, settings, self.name, store, reach, lambda: store(attempt))


__all__ = ["V2Backend"]
