"""The ``c10d`` rendezvous backend: one TCPStore, O(N) operations per round.

``--rdzv-backend=c10d --rdzv-endpoint=HOST[:29400] --rdzv-id=JOB``: the agent whose
machine owns HOST hosts the store (bound to that address only); every other agent
connects to it. ``--rdzv-conf`` keys are listed in ``settings.ACCEPTED_KEYS``.

Importing this package is cheap (no torch); ``create_handler`` imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.core.rendezvous import RendezvousHandler, RendezvousParameters


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elastic.rendezvous`` entry point: validate the config, host or reach the store."""
    from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler
    from elastic.plugins.rdzv_c10d.settings import parse_settings

    return C10dRendezvousHandler(params, parse_settings(params))


__all__ = ["create_handler"]
