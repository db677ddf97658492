"""``RoundRendezvousHandler``: the one RendezvousHandler every dynamic backend shares.

A backend (``c10d``, ``etcd-v2``, ``etcd-v3``) only connects: it hands this class two
``CoordinationStore`` views of the job (one for the agent thread, one for the monitor
thread, so a long ``wait`` never holds a heartbeat back) and, for ``c10d``, the store
server it hosts. Every membership rule lives here and in ``protocol``/``monitor``: join
slots, the coordinator, the last call, stable ranks and rank hints, fingerprints, the
job token, liveness, departure, fencing and ``describe``.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from elastic.core.interfaces.coordination import CoordinationStore
from elastic.core.interfaces.rendezvous import (
    JobStatus,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousFencedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreGoneError,
)
from elastic.core.interfaces.store import StoreTimeoutError
from elastic.core.rendezvous.round import records as R
from elastic.core.rendezvous.round.liveness import (
    SERVING_RANKS,
    LivenessTracker,
    add_lost,
    read_lost,
)
from elastic.core.rendezvous.round.monitor import Monitor
from elastic.core.rendezvous.round.presence import PresenceServer, hello_line
from elastic.core.rendezvous.round.progress_lines import Say
from elastic.core.rendezvous.round.protocol import RoundProtocol
from elastic.core.rendezvous.round.settings import RoundSettings
from elastic.core.rendezvous.round.signing import SignedStore
from elastic.core.rendezvous.round.status import describe

log = logging.getLogger(__name__)

S = TypeVar("S", bound=CoordinationStore)

RETRY_PAUSE = 1.0  # s between attempts to reach an unreachable store while (re)joining


class RoundRendezvousHandler(RendezvousHandler):
    def __init__(
        self,
        params: RendezvousParameters,
        settings: RoundSettings,
        backend: str,
        job_store: CoordinationStore,
        monitor_store: CoordinationStore | None,
        addr: str,
        standby: str = "",
        lease_store: CoordinationStore | None = None,
    ) -> None:
        """``monitor_store``/``lease_store``: views of the job on connections of their
        own, for the monitor thread and for the keep-alives (``lease.py``); ``standby``:
        where this node keeps a store ready to take over the job's (``host:port``,
        published in its join records), "" for none."""
        self.params = params
        self.settings = settings
        self.backend = backend
        self.run_id = params.run_id
        # Every record is signed and checked with the job token (signing.py); the raw
        # stores are kept to close them.
        self.job_store = SignedStore(
            job_store, settings.token, params.run_id, write_back=not params.read_only
        )
        self.rdzv_store = self.job_store.sub("rdzv/")
        self._raw_stores = [s for s in (lease_store, monitor_store, job_store) if s is not None]
        self._monitor_store = monitor_store
        self._lease_store = lease_store
        self._current: R.Assignment | None = None
        self._shut = False
        self._left = False
        self._closed_here = False  # set_closed() returned: the job is closed
        self.node_id = R.new_node_id()
        self.addr = addr
        # Every agent listens; the one that becomes rank 0 is connected to (presence.py).
        self._presence: PresenceServer | None = None
        if monitor_store is not None and not params.read_only:
            self._presence = PresenceServer(addr, settings.token, params.run_id)
        node = {
            "id": self.node_id,
            "host": socket.gethostname(),
            "addr": addr,
            "pid": os.getpid(),
            "fp": dict(params.fingerprint),
            "rank_hint": settings.node_rank,
            "presence": self._presence.port if self._presence is not None else 0,
            "standby": standby,
            # whether we join with workers that run on, and wait (``set_workers_kept``)
            "kept": False,
            "waiting": False,
            "workers_round": None,
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
        self._monitor: Monitor | None = None
        if monitor_store is not None and not params.read_only:
            memory = self.job_store.memory  # the newest deciding records seen, node-wide
            self._monitor = Monitor(
                SignedStore(monitor_store, settings.token, params.run_id, memory=memory),
                self.node_id,
                settings.heartbeat_interval,
                settings.heartbeat_timeout,
                self._presence,
                functools.partial(hello_line, settings.token, params.run_id, self.node_id),
                None
                if lease_store is None
                else SignedStore(lease_store, settings.token, params.run_id, memory=memory),
            )
            # Its threads start with the handler, as the presence port does: a round is
            # then only round trips (a thousand nodes starting threads at once, in one
            # process, took a second of the round).
            self._monitor.start()

    @property
    def where(self) -> str:
        return self.job_store.where

    # -- RendezvousHandler ------------------------------------------------------------
    def get_backend(self) -> str:
        return self.backend

    def get_run_id(self) -> str:
        return self.run_id

    def _live_monitor(self) -> Monitor:
        if self._monitor is None or self._shut:
            raise RendezvousError(f"this {self.backend} handler is read-only or shut down")
        if self._monitor.error is not None:
            raise RendezvousConnectionError(str(self._monitor.error))
        return self._monitor

    def _monitor_error(self) -> Exception | None:
        return self._monitor.error if self._monitor is not None else None

    def _phase(self, watch: tuple[int, str] | None, quiet: bool) -> None:
        if self._monitor is not None:
            self._monitor.set_phase(watch, quiet)

    def set_progress(self, say: Say | None) -> None:
        self.protocol.progress = say

    def next_rendezvous(self) -> RendezvousInfo:
        monitor = self._live_monitor()
        monitor.set_round(None, None)  # the old round's liveness no longer matters
        self._current = None
        deadline = time.monotonic() + self.settings.join_timeout
        told = False
        while True:
            try:
                asg, rank = self.protocol.next_round()
                # The serving ranks watch every member: they alone read the roster.
                roster = self.protocol.roster(asg.round) if rank in SERVING_RANKS else None
                break
            except StoreTimeoutError as exc:  # an operation that should be instant hung
                raise RendezvousConnectionError(
                    f"the rendezvous store at {self.where} stopped answering: {exc}"
                ) from None
            except RendezvousStoreGoneError:
                raise
            except RendezvousConnectionError as exc:
                # No answer at all (a partition, a host rebooting): keep trying until
                # join_timeout, so a node cut off for a while rejoins by itself.
                if time.monotonic() + RETRY_PAUSE >= deadline:
                    raise
                if not told:
                    log.warning(
                        "cannot reach the rendezvous store at %s (%s); retrying until "
                        "join_timeout=%gs",
                        self.where,
                        exc,
                        self.settings.join_timeout,
                    )
                    told = True
                time.sleep(RETRY_PAUSE)
        self._live_monitor()  # a store lost meanwhile is an error, not a round
        self._current = asg
        members, ports = (roster.members, roster.presence) if roster is not None else ([], [])
        monitor.set_round(asg, rank, self.protocol.outcome_sent, members, ports)
        self.round_formed(asg)
        return RendezvousInfo(
            store=self.job_store,
            rank=rank,
            world_size=asg.size,
            master_addr=asg.master_addr,
            master_port=asg.master_port,
            round=asg.round,
            node_id=self.node_id,
            change=asg.change,
            deferred=asg.deferred,
        )

    def set_workers_kept(
        self, kept: bool, waiting: bool = False, workers_round: int | None = None
    ) -> None:
        # Read by the round's coordinator from our next join record
        # (``records.kept_first``).
        self.protocol.node.update(
            kept=kept,
            waiting=kept and waiting,
            workers_round=workers_round if kept else None,
        )

    def is_closed(self) -> bool:
        if self._monitor is not None and self._monitor.in_round and not self._shut:
            return self._live_monitor().closed
        return self.protocol.is_closed()

    def set_closed(self) -> None:
        # Every node of a finished job closes it: the first writes the record, bumps the
        # events and wakes a forming round (several requests); the others find it closed.
        if not self._known_closed() and not self.protocol.is_closed():
            self.protocol.set_closed()
        self._closed_here = True
        if self._monitor is not None:
            self._monitor.closed_here = True

    def _known_closed(self) -> bool:
        """The job is closed as far as this node already knows, without a store read:
        it closed it, or its monitor read the closed mark (which is never taken back)."""
        return self._closed_here or (self._monitor is not None and self._monitor.closed)

    def on_fenced(self, action: Callable[[int, float], None] | None) -> None:
        if self._monitor is not None:
            self._monitor.on_fenced = action

    def read_job_store(self) -> SignedStore:
        return self.job_store

    def num_nodes_waiting(self) -> int:
        if self._monitor is None:
            return 0
        return self._live_monitor().waiting

    def lost_nodes(self) -> list[str]:
        if self._monitor is None:
            return []
        monitor = self._live_monitor()
        why = monitor.fenced(self.where)
        if why is not None:
            raise RendezvousFencedError(why)
        return list(monitor.lost)

    def watch_keys(self, keys: Sequence[str]) -> Callable[[], list[bytes] | None] | None:
        """The monitor thread reads ``keys`` (job-level) on its tick, in the request it
        makes anyway: a job watch costs the store nothing more."""
        if self._monitor is None or self._shut:
            return None
        self._monitor.watch_job(list(keys))
        return self._monitor.job_values

    def membership_changed(self) -> bool:
        if self._current is None:
            return False
        return bool(read_lost(self.rdzv_store, self._current.round))

    def peer_heartbeats(self) -> dict[str, bytes | None] | None:
        if self._monitor is None:
            return None
        others = self.round_peers()
        if others is None:
            return None  # no round, or no roster for this job: cannot tell
        # A member that left or finished has no live beat.
        return {m: None if v in R.GONE else v for m, v in self._read_beats(others).items()}

    def round_peers(self) -> list[str] | None:
        """The other members of our last round, from its roster (read once a round);
        None without a round or a roster."""
        asg = self._current
        if asg is None:
            return None
        try:
            roster = self.protocol.roster(asg.round)
        except RendezvousStateError:
            return None
        return [m for m in roster.members if m != self.node_id]

    def _read_beats(self, members: list[str]) -> dict[str, bytes | None]:
        """Each member's heartbeat value; None where it is absent or not the job's."""
        values = self.rdzv_store.read([R.hb_key(m) for m in members])
        return dict(zip(members, values, strict=True))

    def leave(self) -> None:
        """Record that we left (heartbeat "left", and ourselves in the round's lost list)
        so every survivor regroups on its next tick; never blocks for long: the monitor
        thread may be stuck in a partition, so it is not waited for."""
        if self._left or self.params.read_only or self._monitor is None:
            return
        self._left = True
        # Our presence connections close after the departure is written: their "left"
        # makes the serving rank read it at once and tell every other member.
        self._monitor.stop(wait=False, keep_links=True)
        try:
            self.rdzv_store.set(R.hb_key(self.node_id), R.LEFT)
            if self._current is not None:
                add_lost(self.rdzv_store, self._current.round, [self.node_id])
        except RendezvousStoreGoneError:
            pass  # no store, no job left to tell: the agent has said so in its own line
        except RendezvousError as exc:
            log.warning("%s rendezvous: could not record our departure: %s", self.backend, exc)
        finally:
            self._monitor.say_left()

    def shutdown(self) -> bool:
        """Leave the job: "done" when it is closed (our workers finished it), otherwise
        a departure the others regroup after at once."""
        if self._shut:
            return True
        ok = True
        if self._monitor is not None and not self._left:
            finished = False
            try:
                finished = self._current is not None and (
                    self._known_closed() or self.protocol.is_closed()
                )
            except RendezvousError:
                pass
            if finished:
                # Stopped, not joined: its thread ends while the keep-alive lands and
                # "done" is written (it writes no beat), and is joined below.
                self._monitor.stop(wait=False)
                # "done" must be the last write to our beat: a keep-alive in flight lands
                # first (else the store's host waits heartbeat_timeout for us at its exit).
                self._monitor.lease.join(self.settings.heartbeat_interval)
                try:
                    self.rdzv_store.set(R.hb_key(self.node_id), R.DONE)
                except RendezvousError as exc:
                    log.warning("%s rendezvous: could not record shutdown: %s", self.backend, exc)
                    ok = False
            else:
                self.leave()
        self._shut = True
        if self._monitor is not None:
            self._monitor.stop(wait=not self._left)
        if self._presence is not None:
            self._presence.close()
        self.after_shutdown()
        self.close_stores()
        return ok

    def close_stores(self) -> None:
        """Close this node's store connections; idempotent."""
        for store in self._raw_stores:
            store.close()

    def round_formed(self, asg: R.Assignment) -> None:
        """A round with this node in it formed (c10d: learn where the store may move)."""

    def after_shutdown(self) -> None:
        """What a backend does once this node is out (c10d: keep a hosted store up for
        the others a little longer)."""

    def wait_for_members(self, timeout: float) -> None:
        """Until the other members of our last round are done, gone or left (bounded),
        so they can still read job-wide keys at the end."""
        try:
            others = self.round_peers()
        except Exception:  # the store is gone: nobody to wait for
            return
        tracker = LivenessTracker(self.settings.heartbeat_timeout, 0.2)
        deadline = time.monotonic() + timeout
        while others and time.monotonic() < deadline:
            try:
                values = self._read_beats(others)
            except Exception:  # the store is gone: nothing to wait for
                return
            # A key that is gone (a lease expired) is a node that no longer needs the store.
            beats = {m: v for m, v in values.items() if v}
            lost, done = tracker.update(beats, time.monotonic())
            finished = set(lost) | set(done)  # once, not per member: N can be 1000s
            others = [m for m in beats if m not in finished]
            if others:
                time.sleep(0.05)  # only the store's host waits here: the job ends with it

    def describe(self) -> JobStatus:
        return describe(self.job_store, self.rdzv_store, self.protocol, self.params, self.backend)

    # -- for tests ----------------------------------------------------------------
    def _suspend_heartbeats(self) -> None:
        if self._monitor is not None:
            self._monitor.suspend_heartbeats()


def open_round_handler(
    params: RendezvousParameters,
    settings: RoundSettings,
    backend: str,
    connect: Callable[[], S],
    reach: Callable[[S], str],
    connect_thread: Callable[[], S] | None = None,
) -> RoundRendezvousHandler:
    """A round handler on connections of its own: the job's (``connect``; ``reach``
    checks that it answers, so an unreachable store is one line now, and returns this
    node's address toward it) and, unless read-only, the monitor thread's and the
    keep-alives' (``connect_thread``, default ``connect``). Whatever stops this (a store
    that cannot be reached, Ctrl-C) closes what was opened."""
    opened: list[S] = []

    def new(make: Callable[[], S]) -> S:
        opened.append(make())
        return opened[-1]

    try:
        job_store = new(connect)
        addr = reach(job_store)
        monitor_store = lease_store = None
        if not params.read_only:
            monitor_store = new(connect_thread or connect)
            lease_store = new(connect_thread or connect)
        return RoundRendezvousHandler(
            params, settings, backend, job_store, monitor_store, addr, lease_store=lease_store
        )
    except BaseException:
        for store in opened:
            store.close()
        raise
