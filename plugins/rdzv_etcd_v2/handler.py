"""``EtcdV2RendezvousHandler``: joining, forming and leaving rounds (see the package doc)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import etcd
from elastic.core.rendezvous import (
    JobStatus,
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from elastic.plugins.rdzv_etcd.client import EtcdClient
from elastic.plugins.rdzv_etcd.common import (
    KeepAlive,
    check_fingerprint,
    loads,
    local_host,
    node_id,
    pick_free_port,
    ttl_seconds,
)
from elastic.plugins.rdzv_etcd.store import EtcdStore
from elastic.plugins.rdzv_etcd_v2.monitor import RoundMonitor, describe_job

DEFAULT_PREFIX = "/elastic/rdzv"
DONE = "done"  # a heartbeat value: left cleanly, not lost


@dataclass
class Settings:
    key_prefix: str = DEFAULT_PREFIX
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    keep_alive_interval: float = 1.0
    keep_alive_max_attempt: int = 5

    @property
    def ttl(self) -> int:
        return ttl_seconds(self.keep_alive_interval * self.keep_alive_max_attempt)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> Settings:
        s = cls(
            key_prefix="/" + (params.get("key_prefix", DEFAULT_PREFIX) or "").strip("/"),
            join_timeout=params.get_as_float("join_timeout", 600.0) or 600.0,
            last_call_timeout=params.get_as_float("last_call_timeout", 30.0) or 0.0,
            keep_alive_interval=params.get_as_float("keep_alive_interval", 1.0) or 1.0,
            keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 5) or 5,
        )
        if s.join_timeout <= 0 or s.last_call_timeout < 0 or s.keep_alive_interval <= 0:
            raise RendezvousConfigError(
                "join_timeout and keep_alive_interval must be > 0, last_call_timeout >= 0"
            )
        if s.keep_alive_max_attempt < 1:
            raise RendezvousConfigError("keep_alive_max_attempt must be >= 1")
        return s


class EtcdV2RendezvousHandler(RendezvousHandler):
    def __init__(
        self, params: RendezvousParameters, client: EtcdClient, settings: Settings
    ) -> None:
        self.params = params
        self.client = client
        self.settings = settings
        self.host = local_host(params.local_addr)
        self.node = node_id(self.host)
        self.root = f"{settings.key_prefix.rstrip('/')}/{params.run_id}"
        self.store = EtcdStore(client, f"{self.root}/store")
        self._keepalive = KeepAlive(client, settings.keep_alive_interval)
        self._monitor: RoundMonitor | None = None
        self._alive_key: str | None = None

    # -- paths ---------------------------------------------------------------------------
    def _round_dir(self, r: int) -> str:
        return f"{self.root}/rounds/{r}"

    # -- RendezvousHandler ---------------------------------------------------------------
    def get_backend(self) -> str:
        return "etcd-v2"

    def get_run_id(self) -> str:
        return self.params.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        if self.params.read_only:
            raise RendezvousError("a read-only (status) etcd-v2 handler cannot join")
        self._leave_round()
        deadline = time.monotonic() + self.settings.join_timeout
        if self.is_closed():
            raise RendezvousClosedError(f"the rendezvous of run {self.params.run_id} is closed")
        check_fingerprint(
            self.client,
            f"{self.root}/fingerprint",
            self.params.fingerprint,
            self.params.allow_mismatch,
        )
        while True:
            r = self._open_round()
            assignment_key = f"{self._round_dir(r)}/assignment"
            if self._read_json(assignment_key) is not None:
                self._advance_open_round(r)  # formed, but its former died before opening r+1
                continue
            entry = self._join(r)
            try:
                assignment = self._await_round(r, entry, deadline)
            finally:
                self._keepalive.remove(entry)
            if assignment is None:
                self._delete(entry)  # not admitted to r: join the next one
                continue
            self._delete(entry)
            return self._become_member(r, assignment)

    def is_closed(self) -> bool:
        try:
            self.client.call("read", f"{self.root}/closed")
            return True
        except etcd.EtcdKeyNotFound:
            return False

    def set_closed(self) -> None:
        if self.params.read_only:
            raise RendezvousError("a read-only (status) etcd-v2 handler cannot close the job")
        self.client.call("write", f"{self.root}/closed", json.dumps({"at": time.time()}))

    def num_nodes_waiting(self) -> int:
        return self._monitor.waiting if self._monitor else 0

    def lost_nodes(self) -> list[str]:
        return list(self._monitor.lost) if self._monitor else []

    def shutdown(self) -> bool:
        """Leave cleanly: our heartbeat becomes a permanent "done", which the others do not
        count as lost (the agent calls this on every exit, also when only this node is
        asked to stop; closing the job is ``set_closed``'s business)."""
        ok = True
        if self._monitor:
            self._monitor.stop()
        self._keepalive.stop()
        if self._alive_key and not self.params.read_only:
            try:
                self.client.call("write", self._alive_key, DONE, retry_for=5.0)
            except Exception:  # noqa: BLE001 - reported through the result
                ok = False
        return ok

    def describe(self) -> JobStatus:
        return describe_job(self.client, self.root, self.params, self.settings.ttl, self.store)

    # -- joining -------------------------------------------------------------------------
    def _open_round(self) -> int:
        key = f"{self.root}/open_round"
        try:
            self.client.call("write", key, "0", prevExist=False)
            return 0
        except etcd.EtcdAlreadyExist:
            pass
        value = self.client.call("read", key).value
        try:
            return int(value)
        except (TypeError, ValueError):
            raise_state(key, value)
            raise  # unreachable

    def _advance_open_round(self, r: int) -> None:
        try:
            self.client.call("write", f"{self.root}/open_round", str(r + 1), prevValue=str(r))
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            pass  # someone else opened it already

    def _join(self, r: int) -> str:
        record = {
            "node_id": self.node,
            "host": self.host,
            "port": pick_free_port(),  # this round's MASTER_PORT if we become rank 0
            "pid": _pid(),
            "fingerprint": self.params.fingerprint,
            "joined_at": time.time(),
        }
        result = self.client.call(
            "write",
            f"{self._round_dir(r)}/joins",
            json.dumps(record),
            ttl=self.settings.ttl,
            append=True,  # in-order key: no contention, and the order gives the ranks
        )
        self._keepalive.add(result.key, self.settings.ttl)
        return str(result.key)

    def _await_round(self, r: int, entry: str, deadline: float) -> dict[str, Any] | None:
        """Wait until round ``r`` is formed; the first live joiner forms it.

        Followers only watch the assignment key (one long poll each); the join queue is
        listed by the leader, and by followers once per half TTL to see whether the
        leader's record expired and leadership passed to them. So a round costs O(N)
        requests, not N listings of N records per second.
        """
        last_call_since: float | None = None
        rdir = self._round_dir(r)
        next_listing = 0.0
        leader = False
        while True:
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous of run {self.params.run_id} did not complete within "
                    f"{self.settings.join_timeout:.0f}s (round {r})"
                )
            assignment, a_index = self._read_json_at(f"{rdir}/assignment")
            if assignment is not None:
                return assignment if self.node in assignment["members"] else None
            if self.is_closed():
                raise RendezvousClosedError(f"the rendezvous of run {self.params.run_id} is closed")
            wait = min(1.0, deadline - now)
            if leader or now >= next_listing:
                joins, index = self._list(f"{rdir}/joins")
                keys = [k for k, _ in joins]
                if entry not in keys:
                    return None  # our record expired (a long stall): join again
                leader = keys[0] == entry
                next_listing = now + self.settings.ttl / 2
            if not leader:
                self.client.watch(f"{rdir}/assignment", _next(a_index), wait)
                continue
            n = len(joins)
            if n >= self.params.min_nodes and last_call_since is None:
                last_call_since = now
            done = last_call_since is not None and (
                now - last_call_since >= self.settings.last_call_timeout
            )
            if n >= self.params.max_nodes or done:
                self._form(r, [rec for _, rec in joins[: self.params.max_nodes]])
                continue
            if last_call_since is not None:
                remaining = self.settings.last_call_timeout - (now - last_call_since)
                wait = max(0.0, min(wait, remaining))
            self.client.watch(rdir, _next(index), wait, recursive=True)

    def _form(self, r: int, records: list[dict[str, Any]]) -> None:
        rank0 = records[0]
        assignment = {
            "round": r,
            "members": [rec["node_id"] for rec in records],
            "nodes": [
                {
                    "node_id": rec["node_id"],
                    "host": rec["host"],
                    "pid": rec.get("pid"),
                    "fingerprint": rec.get("fingerprint") or {},
                }
                for rec in records
            ],
            "min_nodes": self.params.min_nodes,
            "max_nodes": self.params.max_nodes,
            "master_addr": rank0["host"],
            "master_port": rank0["port"],
            "formed_at": time.time(),
        }
        try:
            self.client.call(
                "write",
                f"{self._round_dir(r)}/assignment",
                json.dumps(assignment),
                prevExist=False,
            )
        except etcd.EtcdAlreadyExist:
            pass  # another node formed it (we were slow and lost leadership)
        self._advance_open_round(r)

    def _become_member(self, r: int, assignment: dict[str, Any]) -> RendezvousInfo:
        members: list[str] = list(assignment["members"])
        self._alive_key = f"{self._round_dir(r)}/alive/{self.node}"
        self.client.call("write", self._alive_key, "1", ttl=self.settings.ttl)
        self._keepalive.add(self._alive_key, self.settings.ttl)
        self._monitor = RoundMonitor(
            self.client,
            self.root,
            r,
            members,
            self.node,
            self.settings.ttl,
            self.params.max_nodes,
        )
        self.store.timeout = timedelta(seconds=max(60.0, self.settings.join_timeout))
        return RendezvousInfo(
            store=self.store,
            rank=members.index(self.node),
            world_size=len(members),
            master_addr=str(assignment["master_addr"]),
            master_port=int(assignment["master_port"]),
            round=r,
            members=members,
        )

    def _leave_round(self) -> None:
        """Leaving a round deletes our heartbeat so every survivor is woken at once."""
        if self._monitor:
            self._monitor.stop()
            self._monitor = None
        if self._alive_key:
            self._keepalive.remove(self._alive_key)
            self._delete(self._alive_key)
            self._alive_key = None

    # -- small helpers -------------------------------------------------------------------
    def _delete(self, key: str) -> None:
        try:
            self.client.call("delete", key)
        except etcd.EtcdKeyNotFound:
            pass

    def _read_json_at(self, key: str) -> tuple[Any, int]:
        """The JSON at ``key`` (None if absent) and the etcd index of the read."""
        try:
            result = self.client.call("read", key)
        except etcd.EtcdKeyNotFound as exc:
            return None, _index_of(exc)
        return loads(result.value, key), int(result.etcd_index)

    def _read_json(self, key: str) -> Any:
        try:
            return loads(self.client.call("read", key).value, key)
        except etcd.EtcdKeyNotFound:
            return None

    def _list(self, key: str) -> tuple[list[tuple[str, dict[str, Any]]], int]:
        """Children of a directory in key order, and the etcd index the listing is at."""
        try:
            result = self.client.call("read", key, recursive=True, sorted=True)
        except etcd.EtcdKeyNotFound as exc:
            return [], _index_of(exc)
        items = [
            (child.key, loads(child.value, child.key))
            for child in result.leaves
            if child.key != key and not child.dir
        ]
        return items, int(result.etcd_index)


def _index_of(exc: etcd.EtcdKeyNotFound) -> int:
    payload = getattr(exc, "payload", None) or {}
    try:
        return int(payload.get("index", 0))
    except (TypeError, ValueError):
        return 0


def _next(index: int) -> int | None:
    """The watch index after a listing; None (from now on) when the index is unknown,
    since watching from 1 would replay old history and spin."""
    return index + 1 if index > 0 else None


def _pid() -> int:
    return os.getpid()


def raise_state(key: str, value: object) -> None:
    raise RendezvousStateError(f"cannot parse the rendezvous state at etcd key {key!r}: {value!r}")
