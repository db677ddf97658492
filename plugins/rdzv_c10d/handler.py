"""``C10dRendezvousHandler``: the shared round over one TCPStore, which the agent whose
machine owns the endpoint's address hosts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from elastic.core.interfaces.rendezvous import RendezvousConnectionError, RendezvousParameters
from elastic.core.rendezvous import net
from elastic.core.rendezvous.round.handler import RoundRendezvousHandler
from elastic.core.rendezvous.round.settings import RoundSettings
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.plugins.rdzv_c10d.store import (
    GONE_HINT,
    host_store,
    parse_endpoint,
    probe,
    try_listen,
)

log = logging.getLogger(__name__)

FIRST_CONTACT_PAUSE = 0.2  # s between attempts to reach a store that is not up yet
FIRST_CONTACT_QUIET = 3.0  # s of waiting that are normal (the hosting agent is starting)


def job_prefix(run_id: str) -> str:
    """Every key of a job lives under this: two run ids on one store never meet."""
    return f"elastic/{run_id}/"


def first_contact(
    conn: Connection, prefix: str, limit: float, try_hosting: Callable[[], bool]
) -> None:
    """Connect now (fail early, and not inside a round), waiting for a store that is not
    up yet: agents of one job start at the same time on their machines, and the one that
    hosts the store may well be the last to listen. Before we ever reached it, "connection
    refused" means "not started yet", not "gone"; after that, it is final (the monitor
    thread's ``RendezvousStoreGoneError``). Bounded by ``limit`` (``read_timeout``: as
    torch's TCPStore client, which retries a refused connect until its timeout).

    While nobody listens, ``try_hosting`` is asked again to take the endpoint: the agent
    that won it may have died before listening, or something else held the port for a
    moment; whoever can listen on the endpoint hosts, whenever that becomes possible."""
    started = time.monotonic()
    deadline = started + limit
    told = False
    while True:
        try:
            conn.call("check", [prefix])
            return
        except RendezvousConnectionError as exc:  # refused (StoreGone) or no answer
            if try_hosting():
                continue
            if time.monotonic() + FIRST_CONTACT_PAUSE >= deadline:
                raise RendezvousConnectionError(
                    f"the c10d store at {conn.where} did not come up within "
                    f"read_timeout={limit:g}s: {exc}"
                ) from None
            if not told and time.monotonic() - started >= FIRST_CONTACT_QUIET:
                log.warning(
                    "waiting for the c10d store at %s to come up (%s); retrying for up "
                    "to read_timeout=%gs",
                    conn.where,
                    str(exc).split(";")[0],
                    limit,
                )
                told = True
            time.sleep(FIRST_CONTACT_PAUSE)


class C10dRendezvousHandler(RoundRendezvousHandler):
    def __init__(
        self, params: RendezvousParameters, settings: RoundSettings, is_host: bool | None
    ) -> None:
        self.host, self.port = parse_endpoint(params.endpoint)
        where = f"{self.host}:{self.port}"
        self._server: Any = None
        self._may_host = not params.read_only and is_host is not False
        if not self._try_hosting():
            if is_host and not params.read_only:
                raise RendezvousConnectionError(
                    f"--rdzv-conf is_host=true but this machine cannot listen on {where} "
                    "(not one of its addresses, or the port is taken)"
                )
            if params.read_only:
                probe(self.host, self.port)
        try:
            self._connect(params, settings)
        except BaseException:
            self._stop_hosting()
            raise

    def _connect(self, params: RendezvousParameters, settings: RoundSettings) -> None:
        prefix = job_prefix(params.run_id)
        agent_conn = Connection(self.host, self.port, settings.read_timeout, GONE_HINT)
        if params.read_only:
            agent_conn.call("check", [prefix])
        else:
            first_contact(agent_conn, prefix, settings.read_timeout, self._try_hosting)
            agent_conn.open_waiter()
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

    def _try_hosting(self) -> bool:
        """Host the store if this agent may and can listen on the endpoint: at start, and
        again whenever first contact finds nobody listening."""
        if not self._may_host or self._server is not None:
            return False
        sock = try_listen(self.host, self.port)
        if sock is None:
            return False
        self._server = host_store(sock)
        log.info("hosting the c10d rendezvous store on %s:%s", self.host, self.port)
        return True

    def _stop_hosting(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def is_hosting(self) -> bool:
        return self._server is not None

    def after_shutdown(self) -> None:
        if self._server is not None:
            deadline = time.monotonic() + self.settings.close_timeout
            self.wait_for_members(self.settings.close_timeout)
            # Other jobs (other run ids) may share this endpoint, and a node of ours may
            # still be on its way out: serve while anyone else is connected, bounded.
            self.close_stores()
            while self._server.clients and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._server.clients:
                log.warning(
                    "c10d rendezvous: stopping the store at %s with %d client(s) connected",
                    self.where,
                    self._server.clients,
                )
            self._stop_hosting()
