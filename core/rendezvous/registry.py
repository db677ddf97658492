"""The rendezvous backends: the ``elastic.rendezvous`` group, picked by ``--rdzv-backend``.

A backend's entry point is the factory itself, ``create_handler(params) -> handler``.
elastic-launch ships ``c10d``, ``etcd-v3``, ``etcd-v2``, ``etcd`` and ``static``
(``BUILTIN_BACKENDS``; an unknown one of those names means the package is not installed,
and the error says so). Lookup, conflicts and load failures are
``elastic.core.plugin.named``'s, shared with the metrics sinks and checkpointers.
``register_rendezvous_handler`` adds one in-process (torch's spelling); it may not take a
name an installed distribution claims.
"""

from __future__ import annotations

from collections.abc import Callable

from elastic.core.interfaces.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
)
from elastic.core.plugin.named import NamedPluginGroup, PluginNotFoundError

GROUP = "elastic.rendezvous"
BUILTIN_BACKENDS = ("c10d", "etcd", "etcd-v2", "etcd-v3", "static")

HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]


class BackendNotFoundError(RendezvousError, PluginNotFoundError):
    """No backend has the requested name, two claim it, or it cannot be loaded."""


BACKENDS: NamedPluginGroup[HandlerFactory] = NamedPluginGroup(
    GROUP, "rendezvous backend", "backends", BackendNotFoundError, BUILTIN_BACKENDS
)


def register_rendezvous_handler(name: str, factory: HandlerFactory) -> None:
    """Register a backend in-process (the programmatic path; no entry point needed)."""
    BACKENDS.register(name, factory)


def known_backends() -> list[str]:
    return BACKENDS.names()


def get_backend_factory(name: str) -> HandlerFactory:
    """The factory for ``name``; raises ``BackendNotFoundError`` (one line) otherwise."""
    return BACKENDS.load(name)


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the handler for ``params.backend``."""
    return get_backend_factory(params.backend)(params)
