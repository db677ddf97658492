"""Every store call on the agent's paths goes through ``store_call``: whatever the
backend's client raises when its server is gone, the agent sees one error type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from elastic.core.interfaces.rendezvous import RendezvousConnectionError, RendezvousError
from elastic.core.workers.process import Interrupted

T = TypeVar("T")


def store_call(fn: Callable[..., T], *args: Any) -> T:
    """Call the store or handler; a broken connection becomes RendezvousConnectionError.

    torch's TCPStore raises RuntimeError (DistNetworkError) or OSError when its server
    is gone; whatever the backend, the agent must answer with one clear line.
    """
    try:
        return fn(*args)
    except (RendezvousError, Interrupted):
        raise
    except (OSError, RuntimeError) as exc:
        raise RendezvousConnectionError(f"{type(exc).__name__}: {exc}") from exc
