"""Rendezvous. Owns picking a backend by name (``registry``), the standalone one (``local``),
addresses and ports (``net``), what nodes must share (``fingerprint``), the job token and
the etcd password as an agent reads them (``secrets``), asking a store of several
members within a lease (``hedging``) and ``round``, the one algorithm every dynamic
backend runs over a small coordination store.

The interface itself lives in ``elastic.core.interfaces.rendezvous``; it is re-exported
here because ``from elastic.core.rendezvous import RendezvousHandler`` is the path plugin
authors were taught. Imports ``plugin`` (the registry's loader), ``tcpstore`` (the
round's presence port shares its listening limits), ``interfaces``, ``log`` and
``elastic.__version__`` (the fingerprint); contract ``core-rooms`` lets it import
``workers`` too, and no room above it. A public room for plugins (the backends build on
``round``).
"""

from elastic.core.interfaces.rendezvous import *  # noqa: F403
from elastic.core.interfaces.rendezvous import __all__  # noqa: F401
