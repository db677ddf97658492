"""A torch-free client and server for torch's TCPStore wire protocol.

An agent reaches (or hosts) the rendezvous store without importing torch; torch's own
``TCPStore`` clients and servers interoperate with both. Owns ``wire`` (the protocol),
``channel`` (one socket with deadlines) and ``client``, ``server`` with ``peers`` (one
connection it serves), ``store`` (what it serves) and ``admission`` (what a connection
that has not proved the token may cost), ``view`` (a reconnecting connection and a
``CoordinationStore`` view of it), ``dial`` (opening a connection, ours and presence's)
and ``limits`` (what a listening server grants one peer). May import ``interfaces`` and
``log`` (the rooms below it); a public room for plugins.
"""

from elastic.core.tcpstore.client import TCPStoreClient
from elastic.core.tcpstore.server import TCPStoreServer

__all__ = ["TCPStoreClient", "TCPStoreServer"]
