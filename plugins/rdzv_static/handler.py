"""The ``static`` rendezvous: a fixed set of nodes, each told its rank (torchrun's default).

Node rank 0 hosts a TCPStore on ``--master-addr:--master-port``; the others connect to it.
Every ``next_rendezvous`` call is a round. A node's round is derived from one job-wide
counter (``store.add``), so all nodes agree on it without trusting local state, and a
round completes when every node has registered. Node 0 then publishes the assignment as
JSON; the others wait for it.

With a job token (``--rdzv-conf token_file``, or the environment; see
``core/rendezvous/secrets.py``) every agent proves it to node 0's store, and only agents
may touch the keys under ``<run_id>/``: a stranger can neither read nor change the
rounds. The workers use the store too, through torch's own client, which cannot prove a
token: they are served as guests everywhere else (``elastic.core.tcpstore.admission``),
and so is anyone who reaches the port; node 0 says so in one line when the store is
reachable beyond loopback.

The workers use this store, as under torchrun: ``MASTER_ADDR:MASTER_PORT`` is
``--master-addr:--master-port`` and ``TORCHELASTIC_USE_AGENT_STORE=True``, so every worker
connects to it as a client (``init_method="tcp://host:--master-port"`` works, as does
``env://``). torch 2.13 gives the workers' keys no per-attempt prefix (``/default_pg/...``
in every attempt), so node 0 deletes every key outside ``<run_id>/`` before it publishes
a round (``_clear_worker_keys``): no attempt ever reads a key an earlier one left.

The store, its keys and their layout are ``store``'s; what ``elastic status`` reads,
``status``'s. May import both; core's ``interfaces``, ``log``, ``rendezvous.net`` and
``tcpstore.wire``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

from elastic.core.interfaces.rendezvous import (
    JobStatus,
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from elastic.core.interfaces.store import Store, StoreTimeoutError
from elastic.core.log import say
from elastic.core.rendezvous import net
from elastic.core.tcpstore import wire
from elastic.plugins.rdzv_static import status
from elastic.plugins.rdzv_static import store as tcp
from elastic.plugins.rdzv_static.store import (
    ARRIVALS,
    CLOSED,
    FINISHED,
    FINISHED_ALL,
    JOB,
    LATEST,
    LEFT,
    load_json,
    round_key,
)

log = logging.getLogger(__name__)

_CLOSED_MARKER = json.dumps({"closed": True})
LOST_READ_INTERVAL = 0.5  # s between lost_nodes()' reads of the store
# Several handlers may live in one process (tests, embedding): keep node ids distinct.
_local_ids = itertools.count()


class StaticRendezvousHandler(RendezvousHandler):
    """Fixed-size rendezvous over a TCPStore hosted by node rank 0."""

    def __init__(
        self,
        *,
        run_id: str,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout: float,
        shutdown_timeout: float,
        local_addr: str | None = None,
        read_only: bool = False,
        token: bytes | None = None,
    ) -> None:
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.timeout = timedelta(seconds=timeout)
        self.shutdown_timeout = timedelta(seconds=shutdown_timeout)
        self.host = local_addr or socket.gethostname()
        self.node_id = f"{self.host}:{os.getpid()}:{next(_local_ids)}"
        self.prefix = f"{run_id}/"
        self.token = token
        # The agents' keys on the wire: only agents that proved the token touch them, and
        # a round clears every other key (the workers').
        self._agents_keys = (wire.KEY_PREFIX + self.prefix).encode()
        self._server: tcp.TCPStoreServer | None = None  # node 0 hosts the store
        self._store: tcp.PrefixStore | None = None
        self._round: int | None = None
        self._closed = False
        self._lost_read_at = float("-inf")  # when lost_nodes() last asked the store
        self._lost: list[str] = []  # and what it answered
        self.read_only = read_only  # made by `elastic status`: describe() only

    # -- connection ---------------------------------------------------------------

    def _connect(self) -> tcp.PrefixStore:
        if self._store is None:
            if self.rank == 0:
                self._server = tcp.host_store(self.master_port, self.token, self._agents_keys)
                self._say_workers_store_is_open()
            self._store = tcp.connect_store(
                self.master_addr, self.master_port, self.timeout, self.prefix, self.token
            )
            if self.rank == 0:  # lets `elastic status` show the size before a round forms
                self._store.set(JOB, json.dumps({"world_size": self.world_size}))
        return self._store

    def _say_workers_store_is_open(self) -> None:
        """One line, with a token, when the store is reachable beyond loopback."""
        if self.token is None or net.is_loopback(net.route_address("192.0.2.1", 9)):
            return  # TEST-NET-1: no packet is sent, only a route looked up
        say(
            f"elastic: static: the job token guards the agents' keys on the store at port "
            f"{self.master_port}, not the workers' own: torch's TCPStore protocol cannot "
            "check a token, so anyone who reaches that port can read, write and slow the "
            "workers' keys (use --rdzv-backend=c10d for a store closed to strangers)"
        )

    def _wait(self, store: Store, key: str, round_: int, what: str) -> None:
        """Wait for one key (set_closed fills it with a marker, so closing wakes us too)."""
        try:
            tcp.poll_for(store, key, self.timeout)
        except StoreTimeoutError:
            arrived = store.add(ARRIVALS, 0) - round_ * self.world_size
            raise RendezvousTimeoutError(
                f"static rendezvous round {round_} timed out after "
                f"{self.timeout.total_seconds():g}s waiting for {what} "
                f"({max(arrived, 0)} of {self.world_size} nodes arrived; this is node "
                f"rank {self.rank}; raise it with --rdzv-conf timeout=SECONDS)"
            ) from None
        if store.check([CLOSED]):
            raise RendezvousClosedError(f"the static rendezvous of run {self.run_id!r} is closed")
        self._raise_if_a_node_left(store)

    def _raise_if_a_node_left(self, store: Store) -> None:
        if not store.check([LEFT]):
            return
        who = load_json(store, LEFT, self.prefix)
        who = who if isinstance(who, dict) else {}
        raise RendezvousError(
            f"node rank {who.get('rank')} ({who.get('host')}) left the job; a static job has "
            "fixed membership and cannot go on without it (for a job that survives departures "
            "use --rdzv-backend=c10d or etcd-v3 with --nnodes=MIN:MAX)"
        )

    # -- RendezvousHandler --------------------------------------------------------

    def get_backend(self) -> str:
        return "static"

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        if self.read_only:
            raise RendezvousError("a read-only static rendezvous handler cannot join a job")
        if self._closed:
            raise RendezvousClosedError(f"the static rendezvous of run {self.run_id!r} is closed")
        store = self._connect()
        # The round comes from the job-wide counter, not a local one: every node calls
        # next_rendezvous once per round, so the n-th arrival belongs to round n // size.
        arrival = store.add(ARRIVALS, 1)
        round_ = (arrival - 1) // self.world_size
        if store.check([CLOSED]):
            raise RendezvousClosedError(f"the static rendezvous of run {self.run_id!r} is closed")
        self._register(store, round_)
        if self.rank == 0:
            self._wait(store, round_key(round_, "complete"), round_, "every node to register")
            assignment = self._publish(store, round_)
        else:
            key = round_key(round_, "assignment")
            self._wait(store, key, round_, "node rank 0 to publish the round's assignment")
            assignment = self._parse_assignment(load_json(store, key, self.prefix), key)
        self._round = round_
        log.debug("static rendezvous round %d: %s", round_, assignment)
        return RendezvousInfo(
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            master_addr=assignment["master_addr"],
            master_port=assignment["master_port"],
            round=round_,
            node_id=self.node_id,
            members=list(assignment["members"]),
        )

    def _register(self, store: Store, round_: int) -> None:
        key = round_key(round_, f"node/{self.rank}")
        mine = json.dumps({"node_id": self.node_id, "host": self.host, "pid": os.getpid()})
        held = store.compare_set(key, "", mine)
        if bytes(held) != mine.encode():
            other = load_json(store, key, self.prefix)
            who = other.get("node_id") if isinstance(other, dict) else other
            raise RendezvousConfigError(
                f"node rank {self.rank} is already taken in round {round_} by {who}; "
                f"give every node a distinct --node-rank in 0..{self.world_size - 1}"
            )
        if store.add(round_key(round_, "registered"), 1) == self.world_size:
            store.set(round_key(round_, "complete"), "true")

    def _publish(self, store: Store, round_: int) -> dict[str, Any]:
        nodes = []
        for rank in range(self.world_size):
            key = round_key(round_, f"node/{rank}")
            node = load_json(store, key, self.prefix)
            if not isinstance(node, dict) or not isinstance(node.get("node_id"), str):
                raise RendezvousStateError(f"static rendezvous key {self.prefix + key!r}: {node!r}")
            nodes.append(node)
        members = [node["node_id"] for node in nodes]
        self._clear_worker_keys(round_)
        assignment = {
            "round": round_,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "members": members,
        }
        store.set(LATEST, status.latest_record(assignment, nodes))  # for `elastic status`
        store.set(round_key(round_, "assignment"), json.dumps(assignment))
        return assignment

    def _clear_worker_keys(self, round_: int) -> None:
        """Delete the workers' keys (everything outside ``<run_id>/``) before a round forms.

        This is what keeps attempts apart, not ``TORCHELASTIC_RESTART_COUNT``: torch 2.13's
        workers put no attempt prefix on their keys (older torch used
        ``/worker/attempt_<count>``). A prefix from the count would not be enough either:
        each agent reads the count after the round forms, so a node whose workers fail
        at once can spend a restart before a slower node reads it, and two rounds then
        share a count on that node. Clearing is safe here: the round is complete, so
        every node has called ``next_rendezvous``, and an agent stops and reaps its
        workers before it does; no worker of an earlier round is left to write.
        """
        assert self._server is not None  # node 0 publishes, and node 0 hosts
        try:
            gone = self._server.clear(keep_prefix=self._agents_keys)
        except RuntimeError as exc:  # the server's loop ended: the store is gone
            raise RendezvousConnectionError(f"static rendezvous store: {exc}") from None
        log.debug("static rendezvous round %d: cleared %d worker keys", round_, gone)

    def _parse_assignment(self, value: Any, key: str) -> dict[str, Any]:
        ok = (
            isinstance(value, dict)
            and isinstance(value.get("master_addr"), str)
            and isinstance(value.get("master_port"), int)
            and isinstance(value.get("members"), list)
            and value.get("world_size") == self.world_size
        )
        if not ok:
            raise RendezvousStateError(
                f"static rendezvous key {self.prefix + key!r} holds an unexpected "
                f"assignment: {value!r}"
            )
        return value

    def is_closed(self) -> bool:
        if self._closed:
            return True
        if self._store is None:
            return False
        try:
            return self._store.check([CLOSED])
        except RendezvousConnectionError:
            return False

    def set_closed(self) -> None:
        self._closed = True
        store = self._store
        if store is None:
            return
        try:
            store.set(CLOSED, "true")
            # Wake whoever waits in a round around now: they wait on exactly one key, so
            # fill it (only if absent) with a marker; after waking they see CLOSED.
            current = (store.add(ARRIVALS, 0) - 1) // self.world_size
            for round_ in range(max(current - 1, 0), current + 2):
                for name in ("complete", "assignment"):
                    store.compare_set(round_key(round_, name), "", _CLOSED_MARKER)
        except (RendezvousConnectionError, StoreTimeoutError) as exc:
            log.warning("could not mark the static rendezvous closed: %s", exc)

    def leave(self) -> None:
        """We were signalled: tell the others so they end at once instead of waiting for
        us in the next round until the rendezvous timeout."""
        store = self._store
        if store is None or self.read_only:
            return
        try:
            store.compare_set(LEFT, "", json.dumps({"rank": self.rank, "host": self.host}))
            current = (store.add(ARRIVALS, 0) - 1) // self.world_size
            for round_ in range(max(current, 0), current + 2):  # wake a waiting round
                for name in ("complete", "assignment"):
                    store.compare_set(round_key(round_, name), "", _CLOSED_MARKER)
        except (RendezvousConnectionError, StoreTimeoutError) as exc:
            log.warning("could not record this node's departure: %s", exc)

    def lost_nodes(self) -> list[str]:
        """A node that left (``leave``); static has no heartbeats to find a crashed one.
        The agent asks every monitor interval: the store is asked at most every
        ``LOST_READ_INTERVAL`` s, so a job of N nodes costs it 2N requests a second."""
        if self._store is None or self._round is None:
            return []
        now = time.monotonic()
        if now - self._lost_read_at < LOST_READ_INTERVAL:
            return list(self._lost)
        self._lost_read_at = now
        self._lost = []
        if self._store.check([LEFT]):
            who = load_json(self._store, LEFT, self.prefix)
            self._lost = [f"rank {who.get('rank')}" if isinstance(who, dict) else "a node"]
        return list(self._lost)

    def num_nodes_waiting(self) -> int:
        """Nodes already waiting in the next round: another node's workers failed.

        Membership is fixed, so the only way a node arrives early is that it restarted
        after a failure; answering > 0 makes this node's agent stop its workers (which
        may be stuck in a collective with the dead ones) and join that round.
        """
        if self._store is None or self._round is None:
            return 0
        arrivals = self._store.add(ARRIVALS, 0)
        return max(0, arrivals - (self._round + 1) * self.world_size)

    @property
    def use_agent_store(self) -> bool:
        """True: workers are clients of node 0's store, as under torchrun (see the module
        docstring for how attempts are kept apart)."""
        return True

    def describe(self) -> JobStatus:
        return status.describe(
            run_id=self.run_id,
            master_addr=self.master_addr,
            master_port=self.master_port,
            prefix=self.prefix,
            timeout=self.timeout.total_seconds(),
            token=self.token,
        )

    def shutdown(self) -> bool:
        store = self._store
        if store is None:
            return True
        ok = True
        try:
            if store.add(FINISHED, 1) >= self.world_size:
                store.set(FINISHED_ALL, "true")
            # Node 0 leaving a closed job (finished or failed for good): the others still
            # use our store for their exit (barrier, records, this counter); dropping it
            # first would turn their clean exit into "connection reset". Bounded wait.
            # Leaving an open job (this agent was signalled) waits for nobody: the job
            # cannot go on without node 0's store anyway.
            if self.rank == 0 and store.check([CLOSED]):
                try:
                    tcp.poll_for(store, FINISHED_ALL, self.shutdown_timeout)
                except StoreTimeoutError:
                    done = store.add(FINISHED, 0)
                    log.warning(
                        "static rendezvous: only %d of %d nodes finished within %gs; "
                        "stopping the store anyway",
                        done,
                        self.world_size,
                        self.shutdown_timeout.total_seconds(),
                    )
                    ok = False
        except RendezvousConnectionError as exc:
            log.debug("static rendezvous store already gone at shutdown: %s", exc)
            ok = self.rank != 0
        finally:
            if self._store is not None:
                self._store.close()
            if self._server is not None:
                self._server.close()
            self._store, self._server = None, None
        return ok
