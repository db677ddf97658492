"""``C10dRendezvousHandler``: the shared round over one TCPStore, which the agent whose
machine owns the endpoint's address hosts."""

from __future__ import annotations

import logging
from typing import Any

from elastic.core import net
from elastic.core.rendezvous import RendezvousConnectionError, RendezvousParameters
from elastic.core.round.handler import RoundRendezvousHandler
from elastic.core.round.settings import RoundSettings
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.plugins.rdzv_c10d.store import (
    GONE_HINT,
    host_store,
    parse_endpoint,
    probe,
    try_listen,
)

log = logging.getLogger(__name__)


def job_prefix(run_id: str) -> str:
    """Every key of a job lives under this: two run ids on one store never meet."""
    return f"elastic/{run_id}/"


class C10dRendezvousHandler(RoundRendezvousHandler):
    def __init__(
        self, params: RendezvousParameters, settings: RoundSettings, is_host: bool | None
    ) -> None:
        self.host, self.port = parse_endpoint(params.endpoint)
        where = f"{self.host}:{self.port}"
        self._server: Any = None
        hosting = not params.read_only and is_host is not False
        sock = try_listen(self.host, self.port) if hosting else None
        if sock is None and is_host and not params.read_only:
            raise RendezvousConnectionError(
                f"--rdzv-conf is_host=true but this machine cannot listen on {where} "
                "(not one of its addresses, or the port is taken)"
            )
        if sock is not None:
            self._server = host_store(sock)
            log.info("hosting the c10d rendezvous store on %s", where)
        elif params.read_only:
            probe(self.host, self.port)
        prefix = job_prefix(params.run_id)
        agent_conn = Connection(self.host, self.port, settings.read_timeout, GONE_HINT)
        agent_conn.call("check", [prefix])  # connect now: fail early, and not inside a round
        monitor_store = None
        if not params.read_only:
            # Its own connection, opened now so no connection cost lands inside a round.
            monitor_conn = Connection(self.host, self.port, settings.read_timeout, GONE_HINT)
            monitor_conn.call("check", [prefix])
            monitor_store = PrefixStore(monitor_conn, prefix)
        super().__init__(
            params,
            settings,
            "c10d",
            PrefixStore(agent_conn, prefix),
            monitor_store,
            params.local_addr or net.route_address(self.host, self.port),
        )

    @property
    def is_hosting(self) -> bool:
        return self._server is not None

    def after_shutdown(self) -> None:
        if self._server is not None:
            self.wait_for_members(self.settings.close_timeout)
            self._server.close()
            self._server = None
