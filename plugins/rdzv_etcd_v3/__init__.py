"""The ``etcd-v3`` rendezvous backend's store: etcd's v3 API through its JSON gateway
(no v2 API, no gRPC), as a ``CoordinationStore`` for the shared round.

Layout under the store's prefix (e.g. ``/elastic/<run_id>/``): the round's keys as the
round names them (UTF-8 keys, raw byte values, counters in ASCII decimal), heartbeat keys
attached to the client's lease (gone within its TTL when the client dies), and
``.add/<connection>/<thread>``: each client thread's add marker (leased; it makes an
``add`` whose reply was lost count exactly once).

Exports (imported on first use, so importing this package costs nothing):
``EtcdV3Store``, ``store_from_params``, ``CONNECTION_KEYS`` (from ``store``);
``V3Config``, ``EtcdV3AuthError`` (from ``client``).

Owns ``backend`` (``create_handler``: the shared round over this store), ``store``
(``EtcdV3Store``), ``client`` (the JSON gateway over urllib3, across members), ``lease``
(the store's lease and its keep-alive thread) and ``replies`` (what the gateway sends
back, checked). Imports core's ``rendezvous``, ``plugin`` (the ``etcd`` extra's line) and
``interfaces``, and urllib3; may import core's public rooms only (contract
``plugins-public-core``), no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.plugins.rdzv_etcd_v3.client import EtcdV3AuthError, V3Config
    from elastic.plugins.rdzv_etcd_v3.store import CONNECTION_KEYS, EtcdV3Store, store_from_params

_EXPORTS = {
    "EtcdV3Store": "store",
    "store_from_params": "store",
    "CONNECTION_KEYS": "store",
    "V3Config": "client",
    "EtcdV3AuthError": "client",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = ["CONNECTION_KEYS", "EtcdV3AuthError", "EtcdV3Store", "V3Config", "store_from_params"]
