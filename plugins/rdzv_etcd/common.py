"""Pieces of the legacy ``etcd`` backend, kept apart from its protocol: node ids, the local
host, keep-alive refresh, fingerprints, JSON decoding that names the key it failed on.
(``etcd-v2`` and ``etcd-v3`` run the shared round and use none of this.)"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

import etcd
from elastic.core.interfaces.rendezvous import (
    RendezvousConnectionError,
    RendezvousMismatchError,
    RendezvousStateError,
)
from elastic.core.rendezvous import fingerprint
from elastic.plugins.rdzv_etcd.client import EtcdClient


def node_id(host: str) -> str:
    """Unique per handler: two agents on one host (tests, stacked jobs) never collide."""
    return f"{host}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def local_host(local_addr: str | None) -> str:
    return local_addr or socket.getfqdn() or "127.0.0.1"


def ttl_seconds(value: float) -> int:
    """etcd v2 TTLs are whole seconds; never round a short TTL down to 'forever' (0)."""
    return max(1, math.ceil(value))


def loads(text: str | None, key: str) -> Any:
    """JSON from etcd, or ``RendezvousStateError`` naming the key."""
    try:
        return json.loads(text or "")
    except (ValueError, TypeError):
        raise RendezvousStateError(
            f"cannot parse the rendezvous state at etcd key {key!r}: {str(text)[:80]!r}"
        ) from None


class KeepAlive:
    """A daemon thread refreshing TTL'd keys (join records, heartbeats, the run's subroot).

    Each key is refreshed every ``period`` (default: the thread's ``interval``).
    ``refresh=true`` writes do not notify watchers, so heartbeats cost no wake-ups; a key
    that already expired (a long stall) is dropped: its owner's peers treat it as gone.
    """

    def __init__(self, client: EtcdClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self._keys: dict[str, tuple[int, float, float]] = {}  # key -> (ttl, period, due)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-keepalive", daemon=True)
        self._thread.start()

    def add(self, key: str, ttl: int, period: float | None = None) -> None:
        every = period or self.interval
        with self._lock:
            self._keys[key] = (ttl, every, time.monotonic() + every)

    def remove(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def _run(self) -> None:
        while not self._stop.wait(min(self.interval, 0.5)):
            now = time.monotonic()
            with self._lock:
                due = [(k, ttl, every) for k, (ttl, every, at) in self._keys.items() if at <= now]
            for key, ttl, every in due:
                try:
                    self.client.call("refresh", key, ttl=ttl, retry_for=every)
                except etcd.EtcdKeyNotFound:
                    self.remove(key)
                    continue
                except (RendezvousConnectionError, etcd.EtcdException):
                    pass  # etcd briefly away: try again on the next round
                with self._lock:
                    if key in self._keys:
                        self._keys[key] = (ttl, every, time.monotonic() + every)

    def stop(self) -> None:
        self._stop.set()


def check_fingerprint(
    client: EtcdClient, key: str, mine: dict[str, str], allowed: frozenset[str] = frozenset()
) -> None:
    """The first node records the job's fingerprint; later ones must match it except in
    the fields the user allowed to differ."""
    if not mine:
        return
    try:
        client.call("write", key, json.dumps(mine, sort_keys=True), prevExist=False)
        return
    except etcd.EtcdAlreadyExist:
        pass
    job = loads(client.call("read", key).value, key)
    diffs = fingerprint.differences(job, mine, allowed)
    if diffs:
        raise RendezvousMismatchError(fingerprint.describe_differences(diffs), diffs)
