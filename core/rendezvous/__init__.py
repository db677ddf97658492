"""Rendezvous: picking a backend by name (``registry``), the standalone one (``local``),
addresses and ports (``net``), what nodes must share (``fingerprint``) and ``round``, the
one algorithm every dynamic backend runs over a small coordination store.

The interface itself lives in ``elastic.core.interfaces.rendezvous``; it is re-exported
here because ``from elastic.core.rendezvous import RendezvousHandler`` is the path plugin
authors were taught. Imports ``interfaces`` and ``plugin`` (the registry's loader).
"""

from elastic.core.interfaces.rendezvous import *  # noqa: F403
from elastic.core.interfaces.rendezvous import __all__  # noqa: F401
