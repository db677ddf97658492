"""The ``etcd`` rendezvous backend: torch's backend name and ``--rdzv-conf`` keys, run on
the shared round over etcd's v2 API (``backend.py``, the ``etcd-v2`` backend's adapter).

It once ran torchelastic's own etcd protocol with its own, slower rules; now one rule
holds for every dynamic backend (stable ranks, the skipped last call after a departure,
departures, liveness and fencing within ``heartbeat_timeout``). torch's keys keep working:
``protocol``; ``cacert``, ``cert``, ``key`` (TLS); ``etcd_prefix`` (default
``/elastic/etcd``: the job lives in ``<etcd_prefix>/<run_id>/``); ``timeout`` (torch's
name for ``join_timeout``); ``last_call_timeout``. Besides them: the round's keys
(``elastic.core.rendezvous.round.settings``) and the connection's (``username``,
``password`` or ``password_file``, ``read_timeout``, ``retry_timeout``; the password may
also come from the environment, ``elastic.core.rendezvous.secrets``). ``keep_alive_ttl``, the old
protocol's liveness, is refused with a line pointing to ``heartbeat_timeout``.

Owns ``backend`` (the shared round over etcd's v2 API, for ``etcd`` and ``etcd-v2``),
``store`` (the etcd v2 ``CoordinationStore``) and ``client`` (the python-etcd client and
its retries). Imports core's ``rendezvous``, ``plugin`` (the ``etcd`` extra's line) and
``interfaces``, and python-etcd and urllib3; may import core's public rooms only
(contract ``plugins-public-core``), no torch.
"""

from __future__ import annotations

from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.plugins.rdzv_etcd.backend import V2Backend

ETCD = V2Backend(
    name="etcd",
    default_prefix="/elastic/etcd",
    prefix_key="etcd_prefix",
    tls_keys=("cacert", "cert", "key"),
    aliases={"timeout": "join_timeout"},
    refused={
        "keep_alive_ttl": "liveness is the shared round's now: use heartbeat_timeout "
        "(seconds without a heartbeat before a node counts as lost) and heartbeat_interval",
    },
)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elastic.rendezvous`` entry point of ``--rdzv-backend=etcd``."""
    return ETCD.create_handler(params)


__all__ = ["ETCD", "create_handler"]
