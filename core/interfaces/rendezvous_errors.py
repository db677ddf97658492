"""Every rendezvous failure a backend raises or the agent handles, under one base,
``RendezvousError`` (torch's hierarchy, and the ones it lacks: a store gone or moved, a
fenced node, a reused run id, a refused token or fingerprint). Importable from
``elastic.core.interfaces.rendezvous`` as always.

May import nothing from ``elastic``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RendezvousError(Exception):
    """Base of every rendezvous failure."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job finished, late joiners should exit cleanly."""


class RendezvousReusedIdError(RendezvousError):
    """The run id names a job that finished before this node started: not a late node of
    that job (which gets ``RendezvousClosedError``) but a new job given an old id."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete in time."""


class RendezvousConnectionError(RendezvousError):
    """The rendezvous backend (its store or server) cannot be reached."""


class RendezvousStoreGoneError(RendezvousConnectionError):
    """The store's host answered that nothing serves the store any more (connection
    refused or reset): its process is gone, as opposed to a host that does not answer at
    all (a partition or a dead machine), which is a plain ``RendezvousConnectionError``."""


class RendezvousStoreMovedError(RendezvousConnectionError):
    """The store moved to another host while a request that cannot be sent again (an
    ADD) was in flight: it may or may not have been applied. The store is there, so this
    is not the end of the job: the caller's retry path takes it (the agent stops this
    attempt's workers and rejoins, as when fenced)."""


class RendezvousFencedError(RendezvousError):
    """This node can no longer confirm it belongs to the current round (it cannot reach
    the rendezvous for the liveness timeout, or the others declared it lost). It must stop
    its workers at once, so it never trains in a world that has moved on, then rejoin."""


class RendezvousStateError(RendezvousError):
    """The rendezvous state is corrupt or unreadable (names the key where it can)."""


class RendezvousGracefulExitError(RendezvousError):
    """This node is not needed (e.g. max_nodes reached) and should exit with success."""


class RendezvousMismatchError(RendezvousError):
    """This node's fingerprint differs from the job's; ``fields`` names each difference."""

    def __init__(self, message: str, fields: Mapping[str, tuple[Any, Any]] | None = None):
        super().__init__(message)
        self.fields = dict(fields or {})


class RendezvousAuthError(RendezvousError):
    """The store refused this node's job token, or asks for one this node lacks."""


class RendezvousConfigError(RendezvousError, ValueError):
    """A user-supplied rendezvous setting is invalid (an unknown --rdzv-conf key, say)."""


class StatusNotSupportedError(RendezvousError):
    """The backend cannot describe a job (``RendezvousHandler.describe``)."""
