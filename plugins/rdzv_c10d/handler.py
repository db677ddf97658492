"""``C10dRendezvousHandler``: the shared round over one TCPStore, which the agent whose
machine owns the endpoint's address hosts.

The store moves when its host leaves on notice (preemption, scale-in, Ctrl-C): every
other agent keeps an empty standby store (marked with ``STANDBY_KEY``) and publishes its
address in its join records; the leaving host writes its departure, stops serving, copies
every key to the first standby of the round's members in rank order (the outcome names
the first ``SUCCESSORS``) and removes that store's mark. The others' connections find it
there (``Connection.find_moved_store``: the same standbys in the same order, skipping
marked ones) and the job regroups
without the host, spending no restart. A host that dies without notice takes the store
with it (the others exit with one line); a late joiner knows only ``--rdzv-endpoint``, so
it cannot find a store that moved.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, overload

from elastic.core.interfaces.rendezvous import (
    RendezvousAuthError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousParameters,
)
from elastic.core.log import say
from elastic.core.rendezvous import net
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.handler import RoundRendezvousHandler
from elastic.core.rendezvous.round.settings import RoundSettings
from elastic.core.tcpstore import TCPStoreClient, TCPStoreServer, wire
from elastic.core.tcpstore.client import TOKEN_HINT
from elastic.core.tcpstore.view import (
    IDLE,
    RECEIVING,
    STANDBY_KEY,
    Connection,
    PrefixStore,
    standby_mark,
)
from elastic.plugins.rdzv_c10d.store import (
    GONE_HINT,
    host_store,
    parse_endpoint,
    parse_endpoints,
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
        # The first endpoint hosts at start; the others are candidates to take it over.
        self._candidates = parse_endpoints(params.endpoint)
        self.host, self.port = self._candidates[0]
        where = f"{self.host}:{self.port}"
        self._server: Any = None
        self._standby: TCPStoreServer | None = None  # ready to take the store over
        self._elastic = params.min_nodes < params.max_nodes  # nodes may join later
        self._conns: list[Connection] = []
        self._may_host = not params.read_only and is_host is not False
        self._token = settings.token  # every store we host or reach asks for it
        # ``is_host=false``: the user runs the store, maybe torch's, which cannot prove the
        # token; accepted at the endpoint (never at a candidate the store moves to).
        self._torch_ok = is_host is False
        if not self._try_hosting():
            if is_host and not params.read_only:
                raise RendezvousConnectionError(
                    f"--rdzv-conf is_host=true but this machine cannot listen on {where} "
                    "(not one of its addresses, or the port is taken)"
                )
            if params.read_only and len(self._candidates) == 1:
                probe(self.host, self.port)
        try:
            self._connect(params, settings)
        except BaseException:  # a store unreachable, Ctrl-C: close what was opened
            for conn in self._conns:
                conn.close()
            self._stop_hosting()
            if self._standby is not None:
                self._standby.close()
            raise

    def _connect(self, params: RendezvousParameters, settings: RoundSettings) -> None:
        prefix = job_prefix(params.run_id)
        agent_conn = Connection(
            self.host, self.port, settings.read_timeout, GONE_HINT, settings.token, self._torch_ok
        )
        agent_conn.successors = self._candidates[1:]  # where a moved store may be already
        self._conns = [agent_conn]  # closed by __init__ if anything below fails
        if params.read_only:
            agent_conn.call("check", [prefix])
        else:
            first_contact(agent_conn, prefix, settings.read_timeout, self._try_hosting)
            agent_conn.open_waiter()
        monitor_store = lease_store = None
        addr = params.local_addr or net.route_address(self.host, self.port)
        standby = ""
        if not params.read_only:

            def own_connection() -> PrefixStore:
                """Another connection to the same store, opened now so no connection
                cost lands inside a round."""
                host, port = agent_conn.host, agent_conn.port
                conn = Connection(
                    host, port, settings.read_timeout, GONE_HINT, settings.token, self._torch_ok
                )
                conn.successors = self._candidates[1:]
                self._conns.append(conn)
                conn.call("check", [prefix])
                return PrefixStore(conn, prefix)

            monitor_store = own_connection()  # the monitor thread's
            lease_store = own_connection()  # the keep-alives' (``lease.py``)
            if self._server is None:
                self._standby, standby = self._keep_standby(addr)
        super().__init__(
            params,
            settings,
            "c10d",
            PrefixStore(agent_conn, prefix),
            monitor_store,
            addr,
            standby,
            lease_store,
        )

    def _moved_elsewhere(self) -> bool:
        """Whether another candidate endpoint serves a live store: the first endpoint's
        host handed it over, and a new store there would split the job in two."""
        for host, port in self._candidates[1:]:
            found = standby_mark(host, port, 2.0, self._token)
            if found is not None:
                found[1].close()
                if not found[0]:
                    return True
        return False

    def _keep_standby(self, addr: str) -> tuple[TCPStoreServer, str]:
        """An idle store ready to take the job's over, and its published address: on a
        candidate endpoint when this machine owns one (a joiner finds it there), else on
        any free port of ``addr``."""
        mark = {wire_key(STANDBY_KEY): IDLE}
        for host, port in self._candidates[1:]:
            sock = try_listen(host, port)
            if sock is not None:
                server = TCPStoreServer(sock=sock, data=mark, token=self._token)
                return server, net.join_host_port(host, port)
        server = TCPStoreServer(addr, 0, data=mark, token=self._token)
        return server, net.join_host_port(addr, server.port)

    def _try_hosting(self) -> bool:
        """Host the store if this agent may and can listen on the endpoint: at start, and
        again whenever first contact finds nobody listening."""
        if not self._may_host or self._server is not None or self._moved_elsewhere():
            return False
        sock = try_listen(self.host, self.port)
        if sock is None:
            return False
        self._server = host_store(sock, self._token)
        log.info("hosting the c10d rendezvous store on %s:%s", self.host, self.port)
        if self._token is None and not net.is_loopback(sock.getsockname()[0]):
            say(
                f"elastic: c10d: the store at {self.host}:{self.port} is open to anyone on the "
                "network, who could end, fail or reshape this job; give every node the same "
                f"job token to close it ({TOKEN_HINT})"
            )
        if self._elastic and len(self._candidates) == 1:
            say(
                f"elastic: c10d: this agent hosts the store at {self.host}:{self.port}; if it "
                "leaves, the store moves to another member, and nodes that join after that "
                "cannot find it there (name more candidate hosts, --rdzv-endpoint="
                "h0:port,h1:port,..., or use --rdzv-backend=etcd-v3)"
            )
        return True

    def _stop_hosting(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def is_hosting(self) -> bool:
        return self._server is not None or self._took_over()

    def _took_over(self) -> bool:
        """Our standby store was handed the job's: we host it now."""
        standby = self._standby
        return standby is not None and not standby.holds(wire_key(STANDBY_KEY))

    def round_formed(self, asg: R.Assignment) -> None:
        successors = Successors(self._candidates, asg.successors)
        for conn in self._conns:
            conn.successors = successors

    def leave(self) -> None:
        super().leave()  # the departure is written first: it travels with the store
        if self._server is not None and self._current is not None:
            self._hand_over(self._current)

    def _hand_over(self, asg: R.Assignment) -> None:
        """Copy every key to the first member's standby that takes it, then stop.

        The standby is told it is receiving before this store stops answering, so the
        others' connections wait for it rather than take our closing for a death."""
        mine = self.protocol.node.get("standby")
        standbys = [s for s in asg.successors if s and s != mine]
        # A candidate endpoint first: a node joining later finds the store there.
        candidates = {net.join_host_port(h, p) for h, p in self._candidates}
        standbys.sort(key=lambda s: s not in candidates)
        data: dict[bytes, bytes] | None = None  # taken when the first standby answers
        for standby in standbys:
            host, port = parse_endpoint(standby)
            try:
                client = TCPStoreClient(host, port, self.settings.read_timeout, token=self._token)
            except (RendezvousConnectionError, RendezvousAuthError):
                continue  # nothing there, or nothing that proves the token: not ours
            try:
                client.set(STANDBY_KEY, RECEIVING)
                if data is None:
                    data = self._server.close_and_take()
                    self._server = None
                for chunk in _chunks(data):
                    client.multi_set([k for k, _ in chunk], [v for _, v in chunk])
                client.delete_key(STANDBY_KEY)  # last: now it is the job's store
            except RendezvousConnectionError as exc:
                log.warning("c10d rendezvous: could not hand the store to %s: %s", standby, exc)
                continue
            finally:
                client.close()
            say(f"elastic: handed the c10d rendezvous store over to {standby}; leaving")
            return
        log.warning("c10d rendezvous: no member took the store over; the job loses it")

    def after_shutdown(self) -> None:
        if self._took_over():  # serve as the host we became, below
            self._server, self._standby = self._standby, None
        if self._standby is not None:
            self._standby.close()
            self._standby = None
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


class Successors(Sequence[tuple[str, int]]):
    """Where the store may have moved: the candidate endpoints, then the round's first
    standbys in rank order (``Assignment.successors``). Worked out on first use, when a
    connection looks for a moved store: nobody parses them while the store stays put."""

    def __init__(self, candidates: list[tuple[str, int]], standbys: list[str]) -> None:
        self._candidates, self._standbys = candidates, standbys
        self._endpoints: list[tuple[str, int]] | None = None

    def _all(self) -> list[tuple[str, int]]:
        if self._endpoints is None:  # two threads may both parse: the same result
            parsed = []
            for standby in self._standbys if isinstance(self._standbys, list) else []:
                if not isinstance(standby, str):
                    continue
                try:
                    parsed.append(parse_endpoint(standby))
                except RendezvousConfigError:  # "" (none), or not an endpoint: skipped
                    continue
            self._endpoints = list(dict.fromkeys([*self._candidates, *parsed]))
        return self._endpoints

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[str, int]]: ...
    def __getitem__(self, index: int | slice) -> tuple[str, int] | Sequence[tuple[str, int]]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())


CHUNK_BYTES = 4 << 20  # per MULTI_SET of a handover, well under a request's 64 MiB cap


def _chunks(data: dict[bytes, bytes]) -> list[list[tuple[str, bytes]]]:
    """The store's keys as a client names them (without the wire's prefix, which the
    client adds again), in MULTI_SETs of at most about ``CHUNK_BYTES``."""
    chunks: list[list[tuple[str, bytes]]] = [[]]
    size = 0
    for raw, value in data.items():
        key = raw.decode("utf-8", "surrogateescape").removeprefix(wire.KEY_PREFIX)
        if chunks[-1] and size + len(raw) + len(value) > CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append((key, value))
        size += len(raw) + len(value)
    return chunks


def wire_key(key: str) -> bytes:
    """``key`` as a server holds it (what a client sends for it)."""
    return (wire.KEY_PREFIX + key).encode()
