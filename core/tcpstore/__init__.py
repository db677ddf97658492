"""A torch-free client and server for torch's TCPStore wire protocol.

An agent reaches (or hosts) the rendezvous store without importing torch; torch's own
``TCPStore`` clients and servers interoperate with both. ``wire`` is the protocol.
"""

from elastic.core.tcpstore.client import TCPStoreClient
from elastic.core.tcpstore.server import TCPStoreServer

__all__ = ["TCPStoreClient", "TCPStoreServer"]
