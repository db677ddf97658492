"""``C10dRendezvousHandler``: the RendezvousHandler over a TCPStore."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from typing import Any

from elastic.core.rendezvous import (
    JobStatus,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from elastic.core.store import StoreTimeoutError
from elastic.plugins.rdzv_c10d import records as R
from elastic.plugins.rdzv_c10d.heartbeat import LivenessTracker, Monitor
from elastic.plugins.rdzv_c10d.protocol import RoundProtocol
from elastic.plugins.rdzv_c10d.settings import Settings
from elastic.plugins.rdzv_c10d.store import (
    PrefixStore,
    connect_store,
    host_store,
    parse_endpoint,
    probe,
    route_address,
    try_listen,
)

log = logging.getLogger(__name__)


def job_prefix(run_id: str) -> str:
    """Every key of a job lives under this: two run ids on one store never meet."""
    return f"elastic/{run_id}/"


class C10dRendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters, settings: Settings) -> None:
        self.params = params
        self.settings = settings
        self.run_id = params.run_id
        self.host, self.port = parse_endpoint(params.endpoint)
        where = f"{self.host}:{self.port}"
        self._server: Any = None
        self._monitor_client: Any = None
        self._monitor: Monitor | None = None
        self._current: R.Assignment | None = None
        self._shut = False

        hosting = not params.read_only and settings.is_host is not False
        sock = try_listen(self.host, self.port) if hosting else None
        if sock is None and settings.is_host and not params.read_only:
            raise RendezvousConnectionError(
                f"--rdzv-conf is_host=true but this machine cannot listen on {where} "
                "(not one of its addresses, or the port is taken)"
            )
        if sock is not None:
            self._server = host_store(sock, self.host, self.port, settings.read_timeout)
            log.info("hosting the c10d rendezvous store on %s", where)
            client = self._server  # the hosting TCPStore is also a client of itself
        else:
            if params.read_only:
                probe(self.host, self.port)
            client = connect_store(self.host, self.port, settings.read_timeout)
        self._client = client
        self.job_store = PrefixStore(client, job_prefix(self.run_id), where)
        self.rdzv_store = self.job_store.sub("rdzv/")

        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.addr = params.local_addr or route_address(self.host, self.port)
        node = {
            "id": self.node_id,
            "host": socket.gethostname(),
            "addr": self.addr,
            "pid": os.getpid(),
            "fp": dict(params.fingerprint),
            "rank_hint": settings.node_rank,
        }
        self.protocol = RoundProtocol(
            self.rdzv_store,
            settings,
            self.run_id,
            node,
            self._phase,
            self._monitor_error,
            allow_mismatch=params.allow_mismatch,
        )
        if not params.read_only:
            # Its own connection, opened now so no connection cost lands inside a round.
            self._monitor_client = connect_store(self.host, self.port, settings.read_timeout)
            monitor_store = PrefixStore(self._monitor_client, self.rdzv_store.prefix, where)
            self._monitor = Monitor(
                monitor_store,
                self.node_id,
                settings.heartbeat_interval,
                settings.heartbeat_timeout,
            )

    # -- RendezvousHandler ------------------------------------------------------------
    def get_backend(self) -> str:
        return "c10d"

    def get_run_id(self) -> str:
        return self.run_id

    @property
    def is_hosting(self) -> bool:
        return self._server is not None

    def _live_monitor(self) -> Monitor:
        if self._monitor is None or self._shut:
            raise RendezvousError("this c10d handler is read-only or shut down")
        if self._monitor.error is not None:
            raise RendezvousConnectionError(str(self._monitor.error))
        return self._monitor

    def _monitor_error(self) -> Exception | None:
        return self._monitor.error if self._monitor is not None else None

    def _phase(self, watch: tuple[int, str] | None, quiet: bool) -> None:
        if self._monitor is not None:
            self._monitor.set_phase(watch, quiet)

    def next_rendezvous(self) -> RendezvousInfo:
        monitor = self._live_monitor()
        monitor.start()
        monitor.set_round(None, None)  # the old round's liveness no longer matters
        self._current = None
        try:
            asg = self.protocol.next_round()
        except StoreTimeoutError as exc:  # an operation that should be instant hung
            raise RendezvousConnectionError(
                f"the rendezvous store at {self.host}:{self.port} stopped answering "
                f"(did the hosting agent die?): {exc}"
            ) from None
        self._live_monitor()  # a store lost meanwhile is an error, not a round
        rank = asg.members.index(self.node_id)
        self._current = asg
        monitor.set_round(asg, rank)
        return RendezvousInfo(
            store=self.job_store,
            rank=rank,
            world_size=len(asg.members),
            master_addr=asg.master_addr,
            master_port=asg.master_port,
            round=asg.round,
            members=list(asg.members),
        )

    def is_closed(self) -> bool:
        if self._monitor is not None and self._monitor.in_round and not self._shut:
            return self._live_monitor().closed
        return self.protocol.is_closed()

    def set_closed(self) -> None:
        self.protocol.set_closed()

    def num_nodes_waiting(self) -> int:
        if self._monitor is None or self._monitor._thread is None:
            return 0
        return self._live_monitor().waiting

    def lost_nodes(self) -> list[str]:
        if self._monitor is None or self._monitor._thread is None:
            return []
        return list(self._live_monitor().lost)

    def shutdown(self) -> bool:
        if self._shut:
            return True
        self._shut = True
        ok = True
        if self._monitor is not None:
            self._monitor.stop()
            try:  # "done", not lost: nobody restarts because we left cleanly
                self.rdzv_store.set(R.hb_key(self.node_id), R.DONE)
            except RendezvousError as exc:
                log.warning("c10d rendezvous: could not record shutdown: %s", exc)
                ok = False
        if self._server is not None and self._current is not None:
            self._wait_for_members(self._current)
        self._monitor_client = None
        self._server = None  # the last reference: the TCPStore server stops here
        return ok

    def _wait_for_members(self, asg: R.Assignment) -> None:
        """Keep the store up until the other members shut down or die (bounded), so they
        can still read job-wide keys at the end."""
        others = [m for m in asg.members if m != self.node_id]
        tracker = LivenessTracker(self.settings.heartbeat_timeout, 0.2)
        deadline = time.monotonic() + self.settings.close_timeout
        while others and time.monotonic() < deadline:
            try:
                values = self.rdzv_store.multi_get([R.hb_key(m) for m in others])
            except Exception:  # the store is gone or a key is missing: nothing to wait for
                return
            stale, done = tracker.update(dict(zip(others, values, strict=True)), time.monotonic())
            others = [m for m in others if m not in set(stale) | set(done)]
            if others:
                time.sleep(0.2)
        if others:
            log.warning(
                "c10d rendezvous: stopping the store while %d node(s) still use it", len(others)
            )

    def describe(self) -> JobStatus:
        from elastic.plugins.rdzv_c10d.status import describe

        return describe(self)

    # -- for tests ----------------------------------------------------------------
    def _suspend_heartbeats(self) -> None:
        if self._monitor is not None:
            self._monitor.suspend_heartbeats()
