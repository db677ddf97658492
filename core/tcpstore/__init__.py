"""A torch-free client and server for torch's TCPStore wire protocol.

An agent reaches (or hosts) the rendezvous store without importing torch; torch's own
``TCPStore`` clients and servers interoperate with both. Owns ``wire`` (the protocol),
``channel`` (one socket with deadlines) and ``client``, ``server`` with ``peers`` (one
connection it serves), ``store`` (what it serves) and ``admission`` (what a connection
that has not proved the token may cost), ``view`` (a reconnecting connection and a
``CoordinationStore`` view of it), ``dial`` (opening a connection, and the name every
lookup of ours gives) and ``limits`` (what a listening server grants one peer). May
import ``interfaces`` and ``log`` (the rooms below it); a public room for plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.core.tcpstore.client import TCPStoreClient
    from elastic.core.tcpstore.server import TCPStoreServer

__all__ = ["TCPStoreClient", "TCPStoreServer"]


def __getattr__(name: str) -> object:
    """The client and server on first use: ``dial`` (every lookup of ours, a standalone
    agent's free port) is in this package, and importing it must not bring them along."""
    if name == "TCPStoreClient":
        from elastic.core.tcpstore.client import TCPStoreClient

        return TCPStoreClient
    if name == "TCPStoreServer":
        from elastic.core.tcpstore.server import TCPStoreServer

        return TCPStoreServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
