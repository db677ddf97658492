"""An etcd v3 store's lease (``Lease``): granted on first use, kept alive every third of
its TTL from a daemon thread, revoked on close. When keepalives fail for longer than the
TTL the lease expires and etcd deletes the keys written with it: the keeper grants a new
one and counts the loss (``lost_count``), never re-writing what was lost.

May import ``client`` (the requests) and ``replies``; core's ``interfaces``.
"""

from __future__ import annotations

import logging
import math
import threading

from elastic.core.interfaces.rendezvous import RendezvousConnectionError, RendezvousError
from elastic.plugins.rdzv_etcd_v3.client import EtcdV3Client, LeaseNotFoundError
from elastic.plugins.rdzv_etcd_v3.replies import reading_reply, reply_dict

log = logging.getLogger(__name__)

RETRY_PAUSE = 0.2  # s between a failed keep-alive and the next try


class Lease:
    """This connection's lease: granted lazily, kept alive from a daemon thread."""

    def __init__(self, client: EtcdV3Client, ttl: float) -> None:
        self._client = client
        self.ttl = max(1, math.ceil(ttl))
        self.granted_ttl = self.ttl
        self.lost_count = 0
        self._id: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> int:
        with self._lock:
            return self._id if self._id is not None else self._grant()

    def replace(self, stale: int) -> int:
        """``stale`` is gone from the server: count the loss once and grant a new lease."""
        with self._lock:
            if self._id == stale:
                self._id = None
                self.lost_count += 1
                log.warning(
                    "etcd lease %x expired (no keepalive within its %ds TTL): keys written "
                    "with heartbeat() are gone; granting a new lease",
                    stale, self.granted_ttl,
                )  # fmt: skip
            return self._id if self._id is not None else self._grant()

    def _grant(self) -> int:
        if self._stop.is_set():
            raise RendezvousConnectionError(f"the etcd store at {self._client.url} is closed")
        reply = self._client.call("lease/grant", {"TTL": self.ttl, "ID": 0})
        with reading_reply(self._client.url, "lease/grant"):
            self._id, self.granted_ttl = int(reply["ID"]), int(reply.get("TTL", self.ttl))
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep, name="etcd-v3-lease", daemon=True)
            self._thread.start()
        return self._id

    def _keep(self) -> None:
        failing = False
        while not self._stop.wait(self._pause(failing)):
            with self._lock:
                lease = self._id
            if lease is None:
                continue
            beat = self.granted_ttl / 3
            # Two tries on a member within a beat: one that does not answer (its link cut)
            # is left for the next after half a beat, not waited for.
            attempt = min(self._client.config.read_timeout, beat / 2)
            try:
                reply = self._client.call(
                    "lease/keepalive", {"ID": str(lease)}, retry_for=beat, timeout=attempt
                )
                with reading_reply(self._client.url, "lease/keepalive"):  # no TTL: no lease
                    expired = int(reply_dict(reply, "result").get("TTL", 0)) <= 0
            except LeaseNotFoundError:
                expired = True
            except RendezvousError as exc:
                if not failing:
                    log.warning("etcd lease keepalive failing (will retry): %s", exc)
                failing = True
                continue
            failing = False
            if expired and not self._stop.is_set():
                try:
                    self.replace(lease)
                except RendezvousError as exc:  # the next operation grants instead
                    log.warning("could not grant a new etcd lease: %s", exc)

    def _pause(self, failing: bool) -> float:
        """Seconds before the next keep-alive: a third of the TTL; after one that failed
        (it already took a beat, its retries included), a short pause: waiting a whole
        beat more would leave the lease a single try before it expires."""
        return min(RETRY_PAUSE, self.granted_ttl / 3) if failing else self.granted_ttl / 3

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            lease, self._id = self._id, None
        if lease is None:
            return
        try:  # best effort: unrevoked, it expires after its TTL anyway
            self._client.call("lease/revoke", {"ID": str(lease)}, retry_for=2.0)
        except RendezvousError as exc:
            log.debug("could not revoke etcd lease %x: %s", lease, exc)
