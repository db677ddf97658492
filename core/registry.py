"""Picks the one rendezvous backend named by ``--rdzv-backend``.

Backends come from the ``elastic.rendezvous`` entry-point group (stevedore loads only the
chosen one) or from ``register_rendezvous_handler`` for in-process code. A name claimed
by two distributions is an error naming both; a plugin never silently shadows another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elastic.core import plugins
from elastic.core.rendezvous import RendezvousError, RendezvousHandler, RendezvousParameters

GROUP = "elastic.rendezvous"
BUILTIN_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")

HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]

_registered: dict[str, HandlerFactory] = {}


class BackendNotFoundError(RendezvousError, LookupError):
    """No backend has the requested name, or it cannot be loaded."""


def register_rendezvous_handler(name: str, factory: HandlerFactory) -> None:
    """Register a backend in-process (the programmatic path; no entry point needed)."""
    if name in _registered and _registered[name] is not factory:
        raise ValueError(f"a rendezvous handler named {name!r} is already registered")
    _registered[name] = factory


def known_backends() -> list[str]:
    return sorted({ep.name for ep in plugins.entry_points(GROUP)} | set(_registered))


def get_backend_factory(name: str) -> HandlerFactory:
    if name in _registered:
        return _registered[name]
    candidates = [ep for ep in plugins.entry_points(GROUP) if ep.name == name]
    if not candidates:
        known = ", ".join(known_backends()) or "none"
        hint = ""
        if name in BUILTIN_BACKENDS:
            hint = (
                " (built-in backends exist only when elastic-launch is installed: pip install -e .)"
            )
        raise BackendNotFoundError(
            f"unknown rendezvous backend {name!r}; known backends: {known}{hint}"
        )
    if len(candidates) > 1:
        origins = " and ".join(plugins.describe(ep, GROUP).origin for ep in candidates)
        raise BackendNotFoundError(f"rendezvous backend {name!r} is claimed by {origins}")
    return _load_driver(name, candidates[0])


def _load_driver(name: str, ep: object) -> HandlerFactory:
    from stevedore import DriverManager  # imported here: only a launch with a backend pays
    from stevedore.exception import NoMatches

    # stevedore logs its own warning for a failed load; ours names the distribution.
    logging.getLogger("stevedore").setLevel(logging.ERROR)
    record = plugins.describe(ep, GROUP)  # type: ignore[arg-type]
    failures: list[BaseException] = []
    try:
        manager = DriverManager(
            namespace=GROUP,
            name=name,
            invoke_on_load=False,
            on_load_failure_callback=lambda _mgr, _ep, exc: failures.append(exc),
        )
    except NoMatches:  # stevedore's answer when the only candidate failed to load
        manager = None
    if failures or manager is None or not manager.extensions:
        cause = plugins.format_exception(failures[0]) if failures else "it could not be loaded"
        raise BackendNotFoundError(
            f"rendezvous backend {name!r} from {record.origin} failed to load: {cause}"
        )
    return manager.driver  # type: ignore[no-any-return]


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the handler for ``params.backend``."""
    return get_backend_factory(params.backend)(params)
