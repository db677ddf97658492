"""Rendezvous. Owns picking a backend by name (``registry``), the standalone one (``local``),
addresses and ports (``net``), what nodes must share (``fingerprint``) and ``round``, the
one algorithm every dynamic backend runs over a small coordination store.

The interface itself lives in ``elastic.core.interfaces.rendezvous``; it is re-exported
here because ``from elastic.core.rendezvous import RendezvousHandler`` is the path plugin
authors were taught. May import the rooms below it: ``plugin`` (the registry's loader),
``tcpstore`` (the presence port shares its listening limits), ``workers``, ``interfaces``
and ``log``; a public room for plugins (the backends build on ``round``).
"""

from elastic.core.interfaces.rendezvous import *  # noqa: F403
from elastic.core.interfaces.rendezvous import __all__  # noqa: F401
