"""Background liveness for a formed round, and the read-only job description.

The agent asks ``lost_nodes()`` every 0.1 s, so the answer is a cached value that one
thread per handler keeps fresh: it lists the round's heartbeats, then long-polls the
heartbeat directory. A heartbeat's TTL expiry or deletion is an etcd event, so survivors
learn about a dead member as soon as etcd expires its key, without polling each other.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

import etcd
from elastic.core.failures import published_root_cause
from elastic.core.fingerprint import VERSION_FIELDS
from elastic.core.rendezvous import (
    JobStatus,
    MemberStatus,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
)
from elastic.core.store import Store
from elastic.plugins.rdzv_etcd.client import EtcdClient
from elastic.plugins.rdzv_etcd.common import loads


class RoundMonitor:
    def __init__(
        self,
        client: EtcdClient,
        root: str,
        round_: int,
        members: list[str],
        me: str,
        ttl: int,
        max_nodes: int,
    ) -> None:
        self.client = client
        self.root = root
        self.round = round_
        self.members = members
        self.me = me
        self.ttl = ttl
        self.max_nodes = max_nodes
        self.lost: tuple[str, ...] = ()
        self.waiting = 0
        self._seen: set[str] = set()
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-v2-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        alive_dir = f"{self.root}/rounds/{self.round}/alive"
        while not self._stop.is_set():
            try:
                index = self._refresh(alive_dir)
            except (RendezvousError, etcd.EtcdException):
                self._stop.wait(0.5)  # etcd unreachable for now: keep the last answer
                continue
            if self._stop.is_set():
                return
            self.client.watch(alive_dir, index + 1 if index else None, 1.0, recursive=True)

    def _refresh(self, alive_dir: str) -> int:
        try:
            result = self.client.call("read", alive_dir, recursive=True, retry_for=2.0)
            alive = {c.key.rsplit("/", 1)[-1] for c in result.leaves if not c.dir}
            index = int(result.etcd_index)
        except etcd.EtcdKeyNotFound:
            alive, index = set(), 0
        closed = _exists(self.client, f"{self.root}/closed")
        self._seen |= alive
        # A member that never heartbeated may simply not have written its key yet; it
        # counts as lost once it has been seen, or after one TTL.
        grace_over = time.monotonic() - self._started > self.ttl + 1
        lost = [
            m
            for m in self.members
            if m != self.me and m not in alive and (m in self._seen or grace_over)
        ]
        # A closed rendezvous means the job is finishing: nodes leaving is not a failure.
        self.lost = () if closed else tuple(lost)
        waiting = 0
        if not closed and len(self.members) < self.max_nodes:
            waiting = _count_live(self.client, f"{self.root}/rounds/{self.round + 1}/joins")
        self.waiting = waiting
        return index


def _exists(client: EtcdClient, key: str) -> bool:
    try:
        client.call("read", key, retry_for=2.0)
        return True
    except etcd.EtcdKeyNotFound:
        return False


def _count_live(client: EtcdClient, key: str) -> int:
    try:
        result = client.call("read", key, recursive=True, retry_for=2.0)
    except etcd.EtcdKeyNotFound:
        return 0
    return sum(1 for c in result.leaves if not c.dir and c.key != key)


def _read(client: EtcdClient, key: str) -> Any:
    try:
        return loads(client.call("read", key).value, key)
    except etcd.EtcdKeyNotFound:
        return None


def describe_job(
    client: EtcdClient, root: str, params: RendezvousParameters, ttl: int, store: Store
) -> JobStatus:
    """Read-only: reads keys, never writes, never joins."""
    closed = _exists(client, f"{root}/closed")
    open_round = _read(client, f"{root}/open_round")
    if open_round is None and not closed:
        raise RendezvousError(
            f"no job with id {params.run_id!r} in etcd at {params.endpoint} (no node has joined it)"
        )
    open_round = int(open_round) if isinstance(open_round, int) else 0
    # The latest formed round is the open one if it formed already, else the one before.
    assignment, current = None, open_round
    for r in (open_round, open_round - 1):
        if r >= 0:
            assignment = _read(client, f"{root}/rounds/{r}/assignment")
            if assignment is not None:
                current = r
                break
    members: list[MemberStatus] = []
    if assignment is not None:
        ages = _heartbeat_ages(client, f"{root}/rounds/{current}/alive", ttl)
        for rank, node in enumerate(assignment.get("nodes", [])):
            fp = node.get("fingerprint") or {}
            nproc = str(fp.get("nproc_per_node", ""))
            members.append(
                MemberStatus(
                    node_id=node["node_id"],
                    host=node.get("host", ""),
                    rank=rank,
                    pid=node.get("pid"),
                    local_world_size=int(nproc) if nproc.isdigit() else None,
                    heartbeat_age=ages.get(node["node_id"]),
                    versions={k: str(fp[k]) for k in VERSION_FIELDS if k in fp},
                )
            )
    waiting_round = current + 1 if assignment is not None else open_round
    waiting = _count_live(client, f"{root}/rounds/{waiting_round}/joins")
    if closed:
        state = "closed"
    elif assignment is not None and any(m.heartbeat_age is not None for m in members):
        state = "running"
    else:
        state = "waiting"
    return JobStatus(
        run_id=params.run_id,
        backend="etcd-v2",
        state=state,
        round=current,
        round_formed_at=assignment.get("formed_at") if assignment else None,
        min_nodes=int((assignment or {}).get("min_nodes", params.min_nodes)),
        max_nodes=int((assignment or {}).get("max_nodes", params.max_nodes)),
        members=members,
        waiting=waiting,
        restarts_used=_restarts(client, root),
        max_restarts=_budget(assignment),
        root_cause=published_root_cause(store, params.run_id),
    )


def _budget(assignment: dict[str, Any] | None) -> int | None:
    for node in (assignment or {}).get("nodes", []):
        budget = str((node.get("fingerprint") or {}).get("max_restarts", ""))
        if budget.isdigit():
            return int(budget)
    return None


def _heartbeat_ages(client: EtcdClient, key: str, ttl: int) -> dict[str, float]:
    try:
        result = client.call("read", key, recursive=True)
    except etcd.EtcdKeyNotFound:
        return {}
    ages: dict[str, float] = {}
    for child in result.leaves:
        if child.dir or child.key == key:
            continue
        remaining = child.ttl if child.ttl is not None else ttl
        ages[child.key.rsplit("/", 1)[-1]] = max(0.0, float(ttl - remaining))
    return ages


def _restarts(client: EtcdClient, root: str) -> int:
    """``agent/restarts`` in the job store (key and value encoded as EtcdStore does)."""
    key = base64.urlsafe_b64encode(b"agent/restarts").decode().rstrip("=")
    try:
        value = client.call("read", f"{root}/store/{key}").value
        return int(base64.b64decode(value or ""))
    except (etcd.EtcdKeyNotFound, ValueError, RendezvousConnectionError):
        return 0
