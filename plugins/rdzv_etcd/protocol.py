"""torchelastic's original etcd rendezvous protocol (after torch's ``etcd_rendezvous.py``).

One JSON state at ``<prefix>/run_<id>/rdzv/active_version`` moves through
``setup -> joinable -> frozen -> final`` (or ``closed``) by test-and-set; every transition
names the version it expects, so a stale node can only fail and retry. Intermediate states
carry a TTL, so a node dying mid-transition cannot wedge the job: the state expires and the
next node re-creates it. Members of a final round keep TTL'd ``v_<ver>/rank_<r>`` keys alive;
a missing one lets a waiting node destroy the round so a new one can form.

Differences from torch's: participants are records (node id, host, MASTER_PORT candidate)
rather than bare ranks, so every node learns rank 0's address and this round's port from
the state itself; a node leaving a round deletes its keep-alive key instead of letting it
expire; every etcd call retries transient failures (see ``client.py``).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import etcd
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)
from elastic.plugins.rdzv_etcd.client import EtcdClient
from elastic.plugins.rdzv_etcd.common import KeepAlive, loads

SETUP_TTL = 5
FROZEN_TTL = 10
JOINABLE_EPHEMERAL_TTL = 10
RUNID_SUBROOT_TTL = 7200  # only cleans up after old runs; far longer than any job step


class RetryableFailure(Exception):
    """Too late for a transition (a race): start over after a short pause."""


class RetryImmediately(Exception):
    """The state moved on in a way that lets us start over at once."""


def cas_delay() -> None:
    time.sleep(random.uniform(0, 0.1))  # spreads out competing test-and-sets


class EtcdRendezvous:
    def __init__(
        self,
        client: EtcdClient,
        keepalive: KeepAlive,
        prefix: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        timeout: float,
        last_call_timeout: float,
        keep_alive_ttl: int,
    ) -> None:
        self.client = client
        self.keepalive = keepalive
        self.prefix = prefix.rstrip("/") + "/"
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.timeout = timeout
        self.last_call_timeout = last_call_timeout
        self.keep_alive_ttl = keep_alive_ttl
        self.deadline = 0.0
        self.my_lease: str | None = None

    def setup(self) -> None:
        """Create the run's directories (idempotent) and keep the run subroot leased."""
        if self.prefix != "/":
            self._mkdir(self.prefix)
        self._mkdir(self.path(""), ttl=RUNID_SUBROOT_TTL)
        self.keepalive.add(self.path(""), RUNID_SUBROOT_TTL, period=RUNID_SUBROOT_TTL / 4)
        self._mkdir(self.path("/rdzv"))
        try:
            self.client.call("write", self.path("/rdzv/version_counter"), "0", prevExist=False)
        except etcd.EtcdAlreadyExist:
            pass

    def path(self, sub: str) -> str:
        if sub and not sub.startswith("/"):
            sub = "/" + sub
        return f"{self.prefix}run_{self.run_id}{sub}"

    # -- the barrier ---------------------------------------------------------------------
    def barrier(self, me: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Join the next rendezvous; returns (final state, our rank)."""
        self.deadline = time.monotonic() + self.timeout
        self.leave()
        while True:
            if time.monotonic() > self.deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous of run {self.run_id} did not complete in {self.timeout:.0f}s"
                )
            try:
                return self._init_phase(me)
            except RetryImmediately:
                pass
            except RetryableFailure:
                time.sleep(0.5)
            except etcd.EtcdKeyError:
                time.sleep(0.2)  # state vanished between two reads (expired): start over

    def leave(self) -> None:
        """Drop our keep-alive so the other members learn at once that we left."""
        if self.my_lease is not None:
            self.keepalive.remove(self.my_lease)
            try:
                self.client.call("delete", self.my_lease)
            except etcd.EtcdKeyNotFound:
                pass
            self.my_lease = None

    def _init_phase(self, me: dict[str, Any]) -> tuple[dict[str, Any], int]:
        try:
            active = self._try_create()
            state = loads(active.value, active.key)
        except etcd.EtcdAlreadyExist:
            active, state = self.get_state()
        status = state.get("status")
        if status == "closed":
            raise RendezvousClosedError(f"the rendezvous of run {self.run_id} is closed")
        if status == "joinable":
            return self._join_phase(state["version"], me)
        if status == "final":
            self._handle_existing(state["version"])
            raise RetryImmediately
        self._wait_for_change(active.etcd_index + 1)
        raise RetryableFailure

    def _try_create(self) -> etcd.EtcdResult:
        # Ephemeral while in "setup": a node dying here leaves nothing behind.
        active = self.client.call(
            "write",
            self.path("/rdzv/active_version"),
            json.dumps({"status": "setup"}),
            prevExist=False,
            ttl=SETUP_TTL,
        )
        try:
            counter = self.client.call("read", self.path("/rdzv/version_counter"))
            version = str(int(counter.value) + 1)
            self.client.call(
                "write",
                self.path("/rdzv/version_counter"),
                version,
                prevIndex=counter.modifiedIndex,
            )
        except (etcd.EtcdKeyNotFound, etcd.EtcdCompareFailed, ValueError) as exc:
            raise RendezvousError(
                f"unexpected state of {self.path('/rdzv/version_counter')}: {exc}"
            ) from None
        self.client.call("write", self.path(f"/rdzv/v_{version}"), None, dir=True, prevExist=False)
        joinable = {
            "status": "joinable",
            "version": version,
            "participants": [],
            "min_nodes": self.min_nodes,  # for `elastic status`; the protocol ignores them
            "max_nodes": self.max_nodes,
        }
        return self.client.call(
            "write",
            self.path("/rdzv/active_version"),
            json.dumps(joinable),
            prevValue=active.value,
        )

    def _join_phase(self, version: str, me: dict[str, Any]) -> tuple[dict[str, Any], int]:
        active, rank = self._join(version, me)
        state = loads(active.value, active.key)
        # The node that brings the count to min_nodes closes the join window after the last
        # call; the state is ephemeral meanwhile, so its death just restarts the round.
        if rank == self.min_nodes - 1 and state["status"] == "joinable":
            self._last_call(version, time.monotonic() + self.last_call_timeout)
        self._wait_while(version, "joinable", until="frozen")
        self._confirm(version, rank)
        final = self._wait_while(version, "frozen", until="final")
        return loads(final.value, final.key), rank

    def _join(self, version: str, me: dict[str, Any]) -> tuple[etcd.EtcdResult, int]:
        while True:
            cas_delay()
            active, state = self.get_state()
            if state["status"] != "joinable":
                raise RetryableFailure
            if state["version"] != version:
                raise RetryImmediately
            rank = len(state["participants"])
            state["participants"].append(me)
            ttl: int | None = None
            if len(state["participants"]) >= self.max_nodes:
                state["status"] = "frozen"
                state["keep_alives"] = []
                ttl = FROZEN_TTL
            elif len(state["participants"]) >= self.min_nodes:
                ttl = JOINABLE_EPHEMERAL_TTL
            try:
                return self._cas(active, state, ttl), rank
            except etcd.EtcdCompareFailed:
                continue

    def _last_call(self, version: str, deadline: float) -> None:
        active, state = self.get_state()
        while True:
            if state["status"] == "frozen" and state["version"] == version:
                return  # max_nodes reached first
            if state["status"] != "joinable" or state["version"] != version:
                raise RetryableFailure
            if time.monotonic() >= deadline:
                state["status"] = "frozen"
                state["keep_alives"] = []
                try:
                    self._cas(active, state, FROZEN_TTL)
                    return
                except etcd.EtcdCompareFailed:
                    cas_delay()
                    active, state = self.get_state()
                    continue
            try:
                # Refresh the ephemeral state's TTL only if it is unchanged.
                active = self.client.call(
                    "write",
                    active.key,
                    active.value,
                    prevValue=active.value,
                    ttl=JOINABLE_EPHEMERAL_TTL,
                )
                wait = min(JOINABLE_EPHEMERAL_TTL / 2, deadline - time.monotonic() + 0.05)
                active, state = self._wait_for_change(active.etcd_index + 1, wait)
            except etcd.EtcdCompareFailed:
                cas_delay()
                active, state = self.get_state()

    def _wait_while(self, version: str, status: str, until: str) -> etcd.EtcdResult:
        active, state = self.get_state()
        while True:
            if state["status"] == until and state["version"] == version:
                return active
            if state["status"] != status or state["version"] != version:
                raise RetryableFailure
            active, state = self._wait_for_change(active.etcd_index + 1)

    def _confirm(self, version: str, rank: int) -> None:
        lease = self.path(f"/rdzv/v_{version}/rank_{rank}")
        while True:
            cas_delay()
            active, state = self.get_state()
            if state["status"] != "frozen" or state["version"] != version:
                raise RetryImmediately
            self.client.call("write", lease, None, ttl=self.keep_alive_ttl)
            state["keep_alives"].append(lease)
            final = len(state["keep_alives"]) == len(state["participants"])
            if final:
                state["status"] = "final"
                state["num_workers_waiting"] = 0
            try:
                self._cas(active, state, None if final else FROZEN_TTL)
            except etcd.EtcdCompareFailed:
                continue
            self.my_lease = lease
            self.keepalive.add(lease, self.keep_alive_ttl, period=self.keep_alive_ttl / 3)
            return

    def _handle_existing(self, version: str) -> None:
        """A final round exists: count ourselves as waiting, then wait for it to end."""
        while True:
            cas_delay()
            active, state = self.get_state()
            if state["status"] != "final" or state["version"] != version:
                raise RetryImmediately
            state["num_workers_waiting"] = state.get("num_workers_waiting", 0) + 1
            try:
                self._cas(active, state, None)
                break
            except etcd.EtcdCompareFailed:
                continue
        active, state = self.get_state()
        while state["status"] == "final" and state["version"] == version:
            alive = self.live_keys(version)
            if any(key not in alive for key in state["keep_alives"]):
                # A member stopped renewing: this round is dead. Compare-and-delete, so
                # we only destroy the very state we judged.
                try:
                    self.client.call("delete", active.key, prevValue=active.value)
                except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                    pass
                return
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(f"rendezvous of run {self.run_id} timed out")
            self.client.watch(
                self.path("/rdzv"), active.etcd_index + 1, min(remaining, 1.0), recursive=True
            )
            active, state = self.get_state()

    # -- helpers -------------------------------------------------------------------------
    def live_keys(self, version: str) -> set[str]:
        try:
            result = self.client.call("read", self.path(f"/rdzv/v_{version}"), recursive=True)
        except etcd.EtcdKeyNotFound:
            return set()
        return {child.key for child in result.leaves if not child.dir}

    def get_state(self) -> tuple[etcd.EtcdResult, dict[str, Any]]:
        active = self.client.call("read", self.path("/rdzv/active_version"))
        return active, loads(active.value, active.key)

    def _cas(self, active: etcd.EtcdResult, state: dict[str, Any], ttl: int | None) -> Any:
        return self.client.call(
            "write", active.key, json.dumps(state), prevValue=active.value, ttl=ttl
        )

    def _wait_for_change(
        self, index: int, timeout: float | None = None
    ) -> tuple[etcd.EtcdResult, dict[str, Any]]:
        overall = max(self.deadline - time.monotonic(), 0.0) + 1.0
        wait = overall if timeout is None else min(timeout, overall)
        # Bounded, so a close or a member restart is noticed within a second or so.
        self.client.watch(self.path("/rdzv/active_version"), index, min(wait, 2.0))
        if time.monotonic() > self.deadline:
            raise RendezvousTimeoutError(f"rendezvous of run {self.run_id} timed out")
        return self.get_state()

    def _mkdir(self, path: str, ttl: int | None = None) -> None:
        try:
            self.client.call("write", path, None, dir=True, prevExist=False, ttl=ttl)
        except (etcd.EtcdAlreadyExist, etcd.EtcdNotFile):
            pass

    def set_closed(self) -> None:
        key = self.path("/rdzv/active_version")
        while True:
            try:
                active, state = self.get_state()
            except etcd.EtcdKeyNotFound:
                try:
                    self.client.call(
                        "write", key, json.dumps({"status": "closed"}), prevExist=False
                    )
                    return
                except etcd.EtcdAlreadyExist:
                    continue
            if state.get("status") == "closed":
                return
            state["status"] = "closed"
            try:
                self._cas(active, state, None)  # a closed state never expires
                return
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                cas_delay()
