"""The ``etcd`` rendezvous backend: torchelastic's original etcd v2 protocol.

See ``protocol.py`` for the state machine. ``--rdzv-conf`` keys: protocol, cacert, cert,
key, username, password, etcd_prefix, timeout, last_call_timeout, keep_alive_ttl,
read_timeout, retry_timeout. ``RendezvousInfo.store`` is an etcd ``Store`` under
``<etcd_prefix>/run_<id>/store`` (job-wide, so it outlives rounds).
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Any

import etcd
from elastic.core.interfaces.rendezvous import (
    JobStatus,
    MemberStatus,
    RendezvousConfigError,
    RendezvousError,
    RendezvousFencedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from elastic.core.rendezvous.fingerprint import VERSION_FIELDS
from elastic.core.rendezvous.net import free_port
from elastic.core.rendezvous.round.monitor import Unanswered
from elastic.plugins.rdzv_etcd.client import (
    CONNECTION_KEYS,
    EtcdClient,
    check_reachable,
    client_from_params,
)
from elastic.plugins.rdzv_etcd.common import (
    KeepAlive,
    check_fingerprint,
    local_host,
    node_id,
    ttl_seconds,
)
from elastic.plugins.rdzv_etcd.protocol import EtcdRendezvous
from elastic.plugins.rdzv_etcd.store import EtcdStore

ACCEPTED_KEYS = (
    *CONNECTION_KEYS,
    "cacert",
    "cert",
    "key",
    "etcd_prefix",
    "timeout",
    "last_call_timeout",
    "keep_alive_ttl",
)
DEFAULT_PREFIX = "/elastic/etcd"

log = logging.getLogger(__name__)


class EtcdRendezvousHandler(RendezvousHandler):
    def __init__(self, params: RendezvousParameters, client: EtcdClient) -> None:
        self.params = params
        self.client = client
        timeout = params.get_as_float("timeout", 600.0)
        last_call = params.get_as_float("last_call_timeout", 30.0)
        ttl = params.get_as_float("keep_alive_ttl", 5.0)
        for key, value, least in (
            ("timeout", timeout, "> 0"),
            ("keep_alive_ttl", ttl, "> 0"),
            ("last_call_timeout", last_call, ">= 0"),
        ):
            assert value is not None
            if not value > 0 and not (least == ">= 0" and value == 0):
                raise RendezvousConfigError(
                    f"--rdzv-conf {key}={params.get(key)}: expected a number of seconds {least}"
                )
        assert timeout is not None and ttl is not None
        self.keep_alive_ttl = ttl_seconds(ttl)
        self.keepalive = KeepAlive(client, interval=max(0.2, self.keep_alive_ttl / 3))
        self.rdzv = EtcdRendezvous(
            client,
            self.keepalive,
            prefix=params.get("etcd_prefix", DEFAULT_PREFIX) or DEFAULT_PREFIX,
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            timeout=timeout,
            last_call_timeout=last_call,
            keep_alive_ttl=self.keep_alive_ttl,
        )
        self.host = local_host(params.local_addr)
        self.node = node_id(self.host)
        self.store = EtcdStore(client, self.rdzv.path("/store"))
        self.store.timeout = timedelta(seconds=max(60.0, timeout))
        self._round: tuple[str, list[str], list[str]] | None = None  # version, ids, leases
        self._lost: tuple[str, ...] = ()
        self._waiting = 0
        self._watcher: threading.Thread | None = None
        self._stop_watch = threading.Event()
        # Fencing: how long etcd has left the watcher's reads unanswered (the shared
        # clock), and whether it found our keep-alive gone (expired: the others count
        # us lost).
        self._unanswered = Unanswered()
        self._evicted = False
        self._left = False
        if not params.read_only:
            self.rdzv.setup()

    def get_backend(self) -> str:
        return "etcd"

    def get_run_id(self) -> str:
        return self.params.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        if self.params.read_only:
            raise RendezvousError("a read-only (status) etcd handler cannot join")
        self._stop_watcher()
        check_fingerprint(
            self.client,
            self.rdzv.path("/fingerprint"),
            self.params.fingerprint,
            self.params.allow_mismatch,
        )
        me = {
            "node_id": self.node,
            "host": self.host,
            "port": free_port(),
            "pid": os.getpid(),
            "versions": {k: v for k, v in self.params.fingerprint.items() if k in VERSION_FIELDS},
        }
        state, rank = self.rdzv.barrier(me)
        members = [p["node_id"] for p in state["participants"]]
        rank0 = state["participants"][0]
        leases = [
            self.rdzv.path(f"/rdzv/v_{state['version']}/rank_{r}") for r in range(len(members))
        ]
        self._round = (state["version"], members, leases)
        self._lost, self._waiting = (), 0
        self._unanswered, self._evicted = Unanswered(), False
        self._stop_watch = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="etcd-monitor", daemon=True)
        self._watcher.start()
        return RendezvousInfo(
            store=self.store,
            rank=rank,
            world_size=len(members),
            master_addr=str(rank0["host"]),
            master_port=int(rank0["port"]),
            round=int(state["version"]),
            members=members,
        )

    def is_closed(self) -> bool:
        try:
            _, state = self.rdzv.get_state()
        except etcd.EtcdKeyNotFound:
            return False
        return state.get("status") == "closed"

    def set_closed(self) -> None:
        if self.params.read_only:
            raise RendezvousError("a read-only (status) etcd handler cannot close the job")
        self.rdzv.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._waiting

    def lost_nodes(self) -> list[str]:
        if self._round is not None and self._watcher is not None:
            self._raise_if_fenced()
        return list(self._lost)

    def membership_changed(self) -> bool:
        """Fresh: is a member's keep-alive of the current round gone (expired or left)?"""
        if self._round is None:
            return False
        version, members, leases = self._round
        alive = self.rdzv.live_keys(version)
        return any(
            lease not in alive
            for node, lease in zip(members, leases, strict=True)
            if node != self.node
        )

    def _raise_if_fenced(self) -> None:
        """A node that cannot confirm its keep-alive for its TTL, or whose keep-alive
        expired, is out of the round: its workers must stop (see core/rendezvous/round/monitor.py
        for the same rule on the other dynamic backends)."""
        if self._evicted:
            raise RendezvousFencedError(
                "the job declared this node lost (its keep-alive expired); stopping its "
                "workers and rejoining"
            )
        silent = self._unanswered.seconds()
        if silent > self.keep_alive_ttl:
            raise RendezvousFencedError(
                f"cannot reach the rendezvous store at {self.params.endpoint} for "
                f"{silent:.1f}s (keep_alive_ttl={self.keep_alive_ttl}s): stopping this "
                "node's workers so it never trains in a world that has moved on; it "
                "rejoins when etcd answers"
            )

    def leave(self) -> None:
        """Delete our keep-alive: the others see it gone at once and regroup without us,
        and without spending a restart (never "done": the job goes on)."""
        if self.params.read_only or self._left:
            return
        self._left = True
        self._stop_watcher()
        try:
            self.rdzv.leave()
        except (RendezvousError, etcd.EtcdException) as exc:
            log.warning("etcd rendezvous: could not record our departure: %s", exc)

    def shutdown(self) -> bool:
        """Out of the job: "done" (a permanent keep-alive the others do not count as
        lost) when the job is closed, a departure otherwise."""
        ok = True
        self._stop_watcher()
        lease = self.rdzv.my_lease
        if lease and not self.params.read_only and not self._left:
            try:
                finished = self.is_closed()
            except (RendezvousError, etcd.EtcdException):
                finished = False
            if finished:
                self.keepalive.remove(lease)
                try:
                    self.client.call("write", lease, "done", retry_for=5.0)
                except Exception:  # noqa: BLE001 - reported through the result
                    ok = False
            else:
                self.leave()
        self.keepalive.stop()
        return ok

    # -- liveness of the current round (cached for the agent's 0.1 s polling) ------------
    def _stop_watcher(self) -> None:
        self._stop_watch.set()
        self._watcher = None

    def _watch(self) -> None:
        assert self._round is not None
        version, members, leases = self._round
        stop = self._stop_watch
        unanswered = self._unanswered
        while not stop.is_set():
            unanswered.asking()
            try:
                active, state = self.rdzv.get_state()
                alive = self.rdzv.live_keys(version)
            except etcd.EtcdKeyNotFound:
                active, state, alive = None, {}, set()
            except (RendezvousError, etcd.EtcdException):
                stop.wait(0.5)
                continue
            unanswered.answered()
            closed = state.get("status") == "closed"
            # Every member wrote its keep-alive before the round became final, so a
            # missing one means expired (dead) or deleted (left).
            lost = [
                node
                for node, lease in zip(members, leases, strict=True)
                if node != self.node and lease not in alive
            ]
            self._lost = () if closed else tuple(lost)
            mine = self.rdzv.my_lease
            if mine is not None and mine in leases and mine not in alive and not closed:
                self._evicted = True
            same = state.get("status") == "final" and state.get("version") == version
            self._waiting = int(state.get("num_workers_waiting", 0)) if same else 0
            index = active.etcd_index + 1 if active is not None else None
            self.client.watch(self.rdzv.path("/rdzv"), index, 1.0, recursive=True)

    def describe(self) -> JobStatus:
        """Read-only: one read of the state and one of the round's keep-alives."""
        try:
            _, state = self.rdzv.get_state()
        except etcd.EtcdKeyNotFound:
            raise RendezvousError(
                f"no job with id {self.params.run_id!r} in etcd at {self.params.endpoint} "
                "(no node has joined it)"
            ) from None
        status = state.get("status")
        version = state.get("version")
        participants: list[dict[str, Any]] = state.get("participants", [])
        alive = self.rdzv.live_keys(version) if version else set()
        leases = [self.rdzv.path(f"/rdzv/v_{version}/rank_{r}") for r in range(len(participants))]
        members = [
            MemberStatus(
                node_id=p["node_id"],
                host=p.get("host", ""),
                rank=rank,
                pid=p.get("pid"),
                local_world_size=None,
                heartbeat_age=0.0 if leases[rank] in alive else None,
                versions=dict(p.get("versions") or {}),
            )
            for rank, p in enumerate(participants)
        ]
        return JobStatus(
            run_id=self.params.run_id,
            backend="etcd",
            state="closed" if status == "closed" else "running" if status == "final" else "waiting",
            round=int(version or 0),
            round_formed_at=None,
            min_nodes=int(state.get("min_nodes", self.params.min_nodes)),
            max_nodes=int(state.get("max_nodes", self.params.max_nodes)),
            members=members,
            waiting=int(state.get("num_workers_waiting", 0)) if status == "final" else 0,
        )


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    params.check_keys(ACCEPTED_KEYS)
    client = client_from_params(params, ca_key="cacert", cert_key="cert", key_key="key")
    check_reachable(client)
    return EtcdRendezvousHandler(params, client)


__all__ = ["ACCEPTED_KEYS", "EtcdRendezvousHandler", "create_handler"]
