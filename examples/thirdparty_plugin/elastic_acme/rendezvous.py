"""The ``acme`` rendezvous backend: elastic's ``c10d``, configured by the Acme scheduler.

Acme starts every node of a job with ``ACME_COORDINATOR=HOST:PORT`` (where the job's
rendezvous store lives) and ``ACME_JOB_ID`` in the environment, so on Acme
``elastic run --rdzv-backend=acme --nnodes=2:4 train.py`` needs nothing else. An
explicit ``--rdzv-endpoint`` / ``--rdzv-id`` still wins.

It wraps the ``c10d`` backend through elastic's public API (``get_rendezvous_handler``)
and delegates every call to it, answering to its own name.
"""

from __future__ import annotations

import dataclasses
import os

from elastic import RendezvousHandler, RendezvousParameters, get_rendezvous_handler
from elastic.core.rendezvous import JobStatus, RendezvousConfigError, RendezvousInfo

ENDPOINT_ENV = "ACME_COORDINATOR"
JOB_ENV = "ACME_JOB_ID"


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elastic.rendezvous`` entry point: the factory itself."""
    endpoint = params.endpoint or os.environ.get(ENDPOINT_ENV, "")
    if not endpoint:
        raise RendezvousConfigError(
            f"the acme backend needs --rdzv-endpoint or {ENDPOINT_ENV}=HOST:PORT"
        )
    run_id = params.run_id
    if run_id in ("", "none"):
        run_id = os.environ.get(JOB_ENV, run_id)
    c10d = dataclasses.replace(params, backend="c10d", endpoint=endpoint, run_id=run_id)
    return AcmeRendezvousHandler(get_rendezvous_handler(c10d))


class AcmeRendezvousHandler(RendezvousHandler):
    """Every call goes to the wrapped c10d handler; only the name is Acme's."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self.inner = inner

    def get_backend(self) -> str:
        return "acme"

    def next_rendezvous(self) -> RendezvousInfo:
        return self.inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()

    def lost_nodes(self) -> list[str]:
        return self.inner.lost_nodes()

    def leave(self) -> None:
        self.inner.leave()

    def membership_changed(self) -> bool:
        return self.inner.membership_changed()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def describe(self) -> JobStatus:
        return dataclasses.replace(self.inner.describe(), backend="acme")
