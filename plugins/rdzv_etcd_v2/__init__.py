"""The ``etcd-v2`` rendezvous backend: the shared round over etcd's v2 API.

The adapter is the one the ``etcd`` backend runs on (``elastic.plugins.rdzv_etcd.backend``);
this backend differs only in its name, its default key prefix (``/elastic/rdzv``) and its
``--rdzv-conf`` spellings: the round's (``elastic.core.rendezvous.round.settings``), the
connection's (``protocol``, ``username``, ``password`` or ``password_file`` or the
environment (``elastic.core.rendezvous.secrets``), ``read_timeout``, ``retry_timeout``),
``ca_cert``, ``ssl_cert``, ``ssl_cert_key`` and ``key_prefix``.
State is JSON; nothing read from etcd is ever unpickled.

etcd 3.4/3.5 serve the v2 API only with ``--enable-v2``, and etcd 3.6 removed it: prefer
the ``etcd-v3`` backend, which needs neither.

No module of its own: it imports ``elastic.plugins.rdzv_etcd.backend`` (the adapter)
and core's ``interfaces``; may import core's public rooms only (contract
``plugins-public-core``).
"""

from __future__ import annotations

from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.plugins.rdzv_etcd.backend import V2Backend

ETCD_V2 = V2Backend(
    name="etcd-v2",
    default_prefix="/elastic/rdzv",
    prefix_key="key_prefix",
    tls_keys=("ca_cert", "ssl_cert", "ssl_cert_key"),
)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elastic.rendezvous`` entry point of ``--rdzv-backend=etcd-v2``."""
    return ETCD_V2.create_handler(params)


__all__ = ["ETCD_V2", "create_handler"]
