"""The ``--standalone`` rendezvous: one node, no server, no torch.

torchrun's standalone mode starts a c10d rendezvous on ``localhost:0``; with a single
node that is only ceremony, so this handler answers at once: rank 0 of 1, an in-process
``LocalStore`` for the agent's job state, and a fresh free port every round for the
workers' ``MASTER_PORT`` so nothing a previous attempt left behind can reach new workers.
``MASTER_ADDR`` is ``localhost``, which is what torchrun's standalone workers see.
"""

from __future__ import annotations

import socket
import threading

from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
)
from elastic.core.interfaces.store import LocalStore
from elastic.core.rendezvous.net import free_port

MASTER_ADDR = "localhost"
BACKEND = "standalone"  # the backend name of a standalone launch


class LocalRendezvousHandler(RendezvousHandler):
    """A single-node rendezvous that never waits and never needs a network peer."""

    def __init__(
        self, run_id: str, local_addr: str | None = "127.0.0.1", master_addr: str = MASTER_ADDR
    ) -> None:
        self._run_id = run_id
        self._local_addr = local_addr or "127.0.0.1"
        self._master_addr = master_addr
        self._store = LocalStore()
        self._round = -1
        self._closed = False
        self._lock = threading.Lock()
        self.node_id = f"{socket.gethostname()}_standalone"

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        with self._lock:
            if self._closed:
                raise RendezvousClosedError(f"the rendezvous of run {self._run_id} is closed")
            self._round += 1
            return RendezvousInfo(
                store=self._store,
                rank=0,
                world_size=1,
                master_addr=self._master_addr,
                master_port=free_port(self._local_addr or "127.0.0.1"),
                round=self._round,
                node_id=self.node_id,
                members=[self.node_id],
            )

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def read_job_store(self) -> LocalStore:
        return self._store

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True

    @property
    def store(self) -> LocalStore:
        """The job store (tests and tools read the agent's job state through it)."""
        return self._store
