"""The ``c10d`` rendezvous backend: the shared round over one TCPStore.

``--rdzv-backend=c10d --rdzv-endpoint=HOST[:29400] --rdzv-id=JOB``: the agent whose
machine owns HOST hosts the store (bound to that address only); every other agent
connects to it. ``--rdzv-conf`` keys: the round's (``elastic.core.rendezvous.round.settings``) and
``C10D_KEYS`` below.

Neither importing this package nor running a handler imports torch.

Owns ``handler`` (``C10dRendezvousHandler``: the shared round over the job's store),
``store`` (hosting or reaching the TCPStore and its ``CoordinationStore`` view),
``succession`` (where the job's store is and how it moves: the standbys, the search
after a move), ``handover`` (the leaving holder's marks, offer and copy) and
``redirect`` (a store opened anew at the first endpoint after the run's moved is pointed
to the live one). Imports core's ``rendezvous`` (the round),
``tcpstore``, ``interfaces`` and ``log``; may import core's public rooms only (contract
``plugins-public-core``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.core.interfaces.rendezvous import RendezvousConfigError

if TYPE_CHECKING:
    from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousParameters

C10D_KEYS = (
    # true: host the store here (fail if we cannot); false: an external store, which with
    # a job token may be torch's own server (it cannot prove the token)
    "is_host",
    "store_type",  # only "tcp" (accepted for torchrun command lines)
)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elastic.rendezvous`` entry point: validate the config, host or reach the store."""
    from elastic.core.rendezvous.round.settings import parse_round_settings
    from elastic.plugins.rdzv_c10d.handler import C10dRendezvousHandler

    settings = parse_round_settings(params, C10D_KEYS)
    store_type = params.get("store_type", "tcp")
    if store_type != "tcp":
        raise RendezvousConfigError(
            f"--rdzv-conf store_type={store_type!r}: the c10d backend supports only 'tcp'"
        )
    return C10dRendezvousHandler(params, settings, params.get_as_bool("is_host"))


__all__ = ["C10D_KEYS", "create_handler"]
