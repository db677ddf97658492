"""``C10dRendezvousHandler``: the shared round over one TCPStore, which the agent whose
machine owns the endpoint's address hosts.

The store moves whenever the agent holding it leaves on notice (preemption, scale-in,
Ctrl-C, its own failure), in any state: in a round, between rounds, during a regroup,
while it is itself receiving the store. It writes its departure, stops serving, copies
every key to the first standby that agrees (``succession.py``: candidate endpoints first,
then the newest round's members in rank order, never a leaving one) and unmarks it. The
others' connections find it there (``Succession.find``) and the job regroups without the
holder, spending no restart; the new holder hands it on the same way when it leaves. A
holder that dies without notice takes the store with it (the others exit with one line).
A node that knows only ``--rdzv-endpoint`` finds a moved store on a candidate endpoint,
or, started on the first endpoint's host, by the redirect the holder writes into the new
store it opened there (``redirect.py``); elsewhere it does not (``succession.py``, "The
limit").
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
)
from elastic.core.log import say
from elastic.core.rendezvous import net
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.handler import RoundRendezvousHandler
from elastic.core.rendezvous.round.settings import RoundSettings
from elastic.core.tcpstore import TCPStoreServer
from elastic.core.tcpstore.client import TOKEN_HINT
from elastic.core.tcpstore.view import Connection, PrefixStore
from elastic.plugins.rdzv_c10d.handover import copy_into, mark_leaving, next_generation, offer
from elastic.plugins.rdzv_c10d.redirect import (
    ARRIVALS_KEY,
    REDIRECT_GRACE,
    REDIRECT_KEY,
    Redirect,
    Watch,
    await_redirect,
    move_connections,
)
from elastic.plugins.rdzv_c10d.store import (
    GONE_HINT,
    first_contact,
    host_store,
    parse_endpoint,
    parse_endpoints,
    probe,
    try_listen,
)
from elastic.plugins.rdzv_c10d.succession import (
    HANDOVER_WAIT,
    IDLE,
    LEAVING,
    STANDBY_KEY,
    Identity,
    Succession,
    Successors,
    new_identity,
    order_successors,
    wire_key,
)

log = logging.getLogger(__name__)


def job_prefix(run_id: str) -> str:
    """Every key of a job lives under this: two run ids on one store never meet."""
    return f"elastic/{run_id}/"


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
        # What this node's connections know of the store, shared (succession.py).
        self._succession = Succession(params.run_id, self._candidates, self._token)
        self._last: R.Assignment | None = None  # the newest round this node was in
        self._own_mark = b""  # our standby's mark once we began to leave
        self._handing = threading.Lock()  # one handover, whichever thread gets there
        self._handed = False
        # When this agent first reached a new store (generation 0) of an elastic job: its
        # first round waits for a redirect (redirect.py); None once looked at, or not so.
        self._new_store_since: float | None = None
        self._watch: Watch | None = None
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
            if self._watch is not None:
                self._watch.stop()
            raise

    def _connect(self, params: RendezvousParameters, settings: RoundSettings) -> None:
        prefix = job_prefix(params.run_id)
        agent_conn = Connection(
            self.host, self.port, settings.read_timeout, GONE_HINT, settings.token, self._torch_ok
        )
        agent_conn.locator = self._succession  # a moved store may be found already
        self._conns = [agent_conn]  # closed by __init__ if anything below fails
        key = self._succession.key
        if params.read_only:
            agent_conn.call("check", [prefix])
            if agent_conn.call("check", [key]):
                self._succession.learn(agent_conn.call("multi_get", [key], False)[0])
        else:
            first_contact(agent_conn, prefix, settings.read_timeout, self._try_hosting)
            # The run's store identity: the first agent to reach a new store names it.
            self._succession.learn(agent_conn.call("compare_set", key, "", new_identity(0)))
            agent_conn.open_waiter()
            known = self._succession.known
            if self._elastic and known is not None and known[0] == 0:
                self._new_store_since = time.monotonic()
                agent_conn.call("add", prefix + ARRIVALS_KEY, 1)
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
                conn.locator = self._succession
                self._conns.append(conn)
                conn.call("check", [prefix])
                return PrefixStore(conn, prefix)

            monitor_store = own_connection()  # the monitor thread's
            lease_store = own_connection()  # the keep-alives' (``lease.py``)
            if self._server is None:
                self._standby, standby = self._keep_standby(addr)
                self._watch = self._watch_first_endpoint(params.run_id)
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

    def _watch_first_endpoint(self, run_id: str) -> Watch:
        """The redirecting watch; it looks once our standby's mark is deleted (handed over)."""
        watch = Watch(self._candidates[0], run_id, self._token, self._live_store)
        if self._standby is not None:
            self._standby.on_delete = lambda key: watch.wake()
        return watch

    def _live_store(self) -> tuple[str, Identity] | None:
        """(address, identity) of the moved store this node holds; None when it holds
        none, or the first one (generation 0, at the first endpoint)."""
        known = self._succession.known
        if self._handed or not self._took_over() or known is None or known[0] == 0:
            return None
        return str(self.protocol.node.get("standby")), known

    def next_rendezvous(self) -> RendezvousInfo:
        since, self._new_store_since = self._new_store_since, None
        if since is not None and self.protocol.last_formed(self.protocol.current_round()) is None:
            arrivals = job_prefix(self.run_id) + ARRIVALS_KEY
            found = await_redirect(
                lambda: self.job_store.read([REDIRECT_KEY])[0],
                lambda: int(self._conns[0].call("add", arrivals, 0)),
                self.params.max_nodes,
                since,
            )
            if found is not None:
                self._follow(found)
        return super().next_rendezvous()

    def _follow(self, target: Redirect) -> None:
        """Leave the new store for the run's moved one ``target`` names (``redirect.py``),
        and keep a standby as any member does."""
        self._succession.redirect = target[:2]
        self._may_host = False
        if self._server is not None:
            time.sleep(REDIRECT_GRACE)  # its other clients read the redirect meanwhile
            self._stop_hosting()
        move_connections(self._conns, target, job_prefix(self.run_id))
        if self._standby is None:
            self._standby, self.protocol.node["standby"] = self._keep_standby(self.addr)
            self._watch = self._watch_first_endpoint(self.run_id)
        say(
            f"elastic: c10d: the run's store moved to {net.join_host_port(*target[:2])} "
            f"(generation {target[2][0]}) before this agent started; redirected to the run's "
            "c10d store there"
        )

    def _try_hosting(self) -> bool:
        """Host the store if this agent may and can listen on the endpoint: at start, and
        again whenever first contact finds nobody listening."""
        if not self._may_host or self._server is not None:
            return False
        sock = try_listen(self.host, self.port)
        if sock is None:
            return False
        # Listening first, then looking: a holder closes this address only after marking
        # its successor, so a handover to a candidate endpoint is seen (succession.py).
        if self._succession.serving_elsewhere():
            sock.close()
            self._may_host = False  # the run's store is elsewhere: never open one here
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
                "from other hosts cannot find it (a replacement on this host is redirected "
                "to it; name more candidate hosts, --rdzv-endpoint=h0:port,h1:port,..., or use "
                "--rdzv-backend=etcd-v3)"
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
        self._last = asg
        self._succession.successors = Successors(self._candidates, asg.successors)

    def leave(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self._standby is not None and not self._own_mark:
            # First: from now on no holder may choose us (or we learn that one did).
            standby = parse_endpoint(str(self.protocol.node.get("standby")))
            self._own_mark = mark_leaving(standby, self._token)
        super().leave()  # the departure is written first: it travels with the store
        if not self.params.read_only:
            self._pass_on()

    def _pass_on(self) -> None:
        """Hand the store on if this node holds it, or is receiving it: once, whichever
        of the leaving thread and ``after_shutdown`` gets here first."""
        with self._handing:
            if self._handed:
                return
            self._handed = True
            held = self._held()
            if held is not None:
                self._hand_over(held)

    def _held(self) -> TCPStoreServer | None:
        """The job's store if this node holds it, waiting (up to ``HANDOVER_WAIT``) for
        one it is receiving; None when it holds none."""
        if self._server is not None:
            return self._server
        standby = self._standby
        if standby is None or self._own_mark in (b"", LEAVING):
            return None  # not a standby, or marked leaving before anyone chose it
        deadline = time.monotonic() + HANDOVER_WAIT
        while standby.holds(wire_key(STANDBY_KEY)) and time.monotonic() < deadline:
            time.sleep(0.02)  # receiving (or IDLE: it holds the store already)
        return None if standby.holds(wire_key(STANDBY_KEY)) else standby

    def _offers(self) -> list[str]:
        """Whom to offer the store: the candidate endpoints, the newest formed round's
        standbys as the store says (this node may have missed rounds), then our own last
        round's."""
        standbys = [net.join_host_port(h, p) for h, p in self._candidates[1:]]
        try:
            newest = self.protocol.last_formed(self.protocol.current_round())
            if newest is not None:
                standbys += newest.successors
        except RendezvousError as exc:
            log.warning("c10d rendezvous: cannot read the newest round's standbys: %s", exc)
        standbys += self._last.successors if self._last is not None else []
        mine = str(self.protocol.node.get("standby") or "")
        return order_successors(standbys, self._candidates, mine)

    def _hand_over(self, server: TCPStoreServer) -> None:
        """Copy every key, one generation on, to the first standby that agrees, then stop.

        The standby is marked receiving before this store stops answering, so the others'
        connections wait for it rather than take our closing for a death."""
        data: dict[bytes, bytes] | None = None  # taken when the first standby agrees
        for standby in self._offers():
            client = offer(standby, self.node_id, self.settings.read_timeout, self._token)
            if client is None:
                continue
            try:
                if data is None:
                    data = next_generation(server.close_and_take(), self.run_id)
                    self._server = self._standby = None
                copy_into(client, data)
            except RendezvousConnectionError as exc:
                log.warning("c10d rendezvous: could not hand the store to %s: %s", standby, exc)
                continue
            finally:
                client.close()
            say(f"elastic: handed the c10d rendezvous store over to {standby}; leaving")
            return
        if data is None:
            log.warning(
                "c10d rendezvous: no member could take the store over; it serves until "
                "close_timeout=%gs",
                self.settings.close_timeout,
            )
        else:
            say("elastic: no member took the c10d rendezvous store over; the job loses it")

    def after_shutdown(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self._left:
            self._pass_on()  # done by now, unless the leaving thread was given up on
        with self._handing:  # a handover on another thread ends first
            pass
        if self._took_over():  # serve as the host we became, below
            self._server, self._standby = self._standby, None
        if self._standby is not None:
            self._standby.close()
            self._standby = None
        if self._server is not None:
            deadline = time.monotonic() + self.settings.close_timeout
            self.wait_for_members(self.settings.close_timeout)
            # Other jobs (other run ids) may share this endpoint, and a node of ours may
            # still be on its way out: serve while anyone else is connected, bounded. A
            # connection silent for a heartbeat timeout is not on its way out: its node is
            # cut off or gone (every live agent keeps alive more often than that).
            self.close_stores()
            silent = self.settings.heartbeat_timeout
            while self._server.clients_heard_within(silent) and time.monotonic() < deadline:
                time.sleep(0.02)  # a local count: looking often costs nothing
            if self._server.clients:
                log.warning(
                    "c10d rendezvous: stopping the store at %s with %d client(s) connected",
                    self.where,
                    self._server.clients,
                )
            self._stop_hosting()
