"""The rendezvous backend contract as a reusable pytest suite.

Any backend registered under the ``elastic.rendezvous`` entry-point group (ours or a third
party's) runs it by subclassing ``RendezvousConformance`` in a test module and providing
one fixture, ``rdzv_target``, that returns a ``RendezvousTarget``: the backend's name, an
endpoint that is up for the duration of the test, and the ``--rdzv-conf`` settings that
make it quick (a last call of a second or two, liveness expiry within a few seconds)::

    import pytest
    from elastic.testing.conformance import RendezvousConformance, RendezvousTarget

    class TestMyBackend(RendezvousConformance):
        @pytest.fixture
        def rdzv_target(self, my_server):
            return RendezvousTarget(
                backend="mine",
                endpoint=my_server.endpoint,
                config={"last_call_timeout": "1", "heartbeat_timeout": "3"},
                last_call_timeout=1.0,
            )

The cases (each a ``test_*`` method, so ``-k`` selects them): a fixed-size round, min/max
with the last call, scale-up via ``num_nodes_waiting``, a SIGKILLed node reported by
``lost_nodes``, a closed rendezvous, run-id isolation, the job ``Store`` (atomic ``add``
across nodes, ``compare_set``, ``wait`` timing out), unknown and out-of-range
``--rdzv-conf`` values, ``describe`` (read-only; an unknown job is an error), a refused
fingerprint, and the membership rules the dynamic backends share (stable ranks, no last
call after a departure, a departure is not completion, ``round_peers`` and
``peer_heartbeats`` when a backend answers them). ``RendezvousTarget.not_applicable``
names the cases a backend skips (a fixed-membership backend has no scale-up).
Nodes run as threads of the test process, each with its own handler, created in order
(node 0 first, so a backend whose first handler hosts its server works), except the node
that gets killed, which runs in a subprocess (``elastic.testing.conformance_node``).
See docs/conformance.md.

Owns the cases; what they run against (the target, the nodes, the round helpers) is
``conformance_target``'s. May import that, ``waits`` and core's public rooms.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from elastic.core.interfaces.coordination import WAIT_TICK
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousError,
    RendezvousHandler,
    RendezvousMismatchError,
    StatusNotSupportedError,
)
from elastic.core.rendezvous.fingerprint import FIELDS as FINGERPRINT_FIELDS
from elastic.core.rendezvous.registry import get_rendezvous_handler
from elastic.testing.conformance_target import (
    Nodes,
    RendezvousTarget,
    assert_one_round,
    by_rank,
    lost_nodes,
    rendezvous_all,
    round_members,
)
from elastic.testing.waits import wait_for

# What a backend's own tests import from here, as they always have.
__all__ = [
    "Nodes",
    "RendezvousConformance",
    "RendezvousTarget",
    "assert_one_round",
    "by_rank",
    "rendezvous_all",
    "round_members",
]


class RendezvousConformance:
    """Subclass as ``Test<Something>`` and define the ``rdzv_target`` fixture."""

    @pytest.fixture
    def nodes(self, rdzv_target: RendezvousTarget) -> Iterator[Nodes]:
        nodes = Nodes(rdzv_target)
        yield nodes
        nodes.close()

    @pytest.fixture(autouse=True)
    def _skip_what_does_not_apply(
        self, request: pytest.FixtureRequest, rdzv_target: RendezvousTarget
    ) -> None:
        rdzv_target.applies(request.node.originalname)

    @pytest.fixture
    def run_id(self) -> str:
        return f"conf-{uuid.uuid4().hex[:10]}"

    def test_fixed_size_round(self, nodes: Nodes, run_id: str) -> None:
        infos = rendezvous_all(nodes.make(run_id, 3, 3, n=3))
        assert_one_round(infos, 3)

    def test_min_max_last_call(self, nodes: Nodes, run_id: str) -> None:
        handlers = nodes.make(run_id, 2, 3, n=2)
        started = time.monotonic()
        infos = rendezvous_all(handlers, timeout=nodes.target.last_call_timeout + 30)
        took = time.monotonic() - started
        assert_one_round(infos, 2)
        # Two of at most three: the round waited out the last call for a third node.
        assert took >= nodes.target.last_call_timeout * 0.5, took

    def test_scale_up_num_nodes_waiting(self, nodes: Nodes, run_id: str) -> None:
        first = nodes.make(run_id, 2, 3, n=2)
        before = rendezvous_all(first)
        assert_one_round(before, 2)
        late = nodes.make(run_id, 2, 3)[0]
        with ThreadPoolExecutor(max_workers=3) as pool:
            late_future = pool.submit(late.next_rendezvous)
            seen = wait_for(
                lambda: all(h.num_nodes_waiting() > 0 for h in first),
                nodes.target.detect_timeout,
            )
            assert seen, "the members never saw the waiting node"
            rest = [pool.submit(h.next_rendezvous) for h in first]
            after = [f.result(timeout=30) for f in rest] + [late_future.result(timeout=30)]
        assert_one_round(after, 3)
        assert after[0].round != before[0].round

    def test_lost_node_detected(self, nodes: Nodes, run_id: str) -> None:
        survivor = nodes.make(run_id, 2, 2)[0]
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(survivor.next_rendezvous)
            proc = nodes.spawn(run_id, 2, 2)
            info = future.result(timeout=60)
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, proc.stderr.read() if proc.stderr else "no output"
        other = json.loads(line)
        assert info.world_size == 2 and other["round"] == info.round
        assert survivor.lost_nodes() == []
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        killed_at = time.monotonic()
        lost = wait_for(survivor.lost_nodes, nodes.target.detect_timeout)
        assert lost, f"no lost node reported {nodes.target.detect_timeout}s after SIGKILL"
        if info.node_id:
            assert lost == [other["node"]]
        assert time.monotonic() - killed_at < nodes.target.detect_timeout

    def test_closed_rendezvous(self, nodes: Nodes, run_id: str) -> None:
        a, b = nodes.make(run_id, 2, 2, n=2)
        rendezvous_all([a, b])
        assert not b.is_closed()
        # A node of the job that arrives late: started before the job closed. (One
        # started after it is a new job given a finished job's id: see the README.)
        late = nodes.make(run_id, 2, 2)[0]
        time.sleep(0.05)
        a.set_closed()
        # Other nodes may learn it through a background thread: allow them a moment.
        wait = nodes.target.detect_timeout
        assert wait_for(a.is_closed, wait) and wait_for(b.is_closed, wait)
        assert wait_for(late.is_closed, wait)
        with pytest.raises(RendezvousClosedError):
            late.next_rendezvous()

    def test_run_id_isolation(self, nodes: Nodes, run_id: str) -> None:
        a = nodes.make(run_id + "-a", 2, 2, n=2)
        b = nodes.make(run_id + "-b", 2, 2, n=2)
        infos = rendezvous_all(a + b)
        assert_one_round(infos[:2], 2)
        assert_one_round(infos[2:], 2)
        infos[0].store.set("only/in/a", b"1")
        assert infos[1].store.check(["only/in/a"])
        assert not infos[2].store.check(["only/in/a"])
        a[0].set_closed()
        assert not b[0].is_closed()

    def test_store_semantics(self, nodes: Nodes, run_id: str) -> None:
        infos = rendezvous_all(nodes.make(run_id, 2, 2, n=2))
        s0, s1 = infos[0].store, infos[1].store
        results: list[int] = []
        lock = threading.Lock()

        def adds(store: Any) -> None:
            for _ in range(15):
                value = store.add("agent/restarts", 1)
                with lock:
                    results.append(value)

        threads = [threading.Thread(target=adds, args=(s,)) for s in (s0, s1, s0, s1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(results) == list(range(1, 61))  # atomic: every value exactly once
        assert s1.add("agent/restarts", 0) == 60
        assert s0.compare_set("agent/restart_claim/0", "", "node-a") == b"node-a"
        assert s1.compare_set("agent/restart_claim/0", "", "node-b") == b"node-a"
        assert s1.compare_set("agent/restart_claim/0", "node-a", "node-b") == b"node-b"
        assert s0.get("agent/restart_claim/0") == b"node-b"
        s0.set("agent/failures/0", b'{"rank": 0}')
        assert s1.get("agent/failures/0") == b'{"rank": 0}'
        assert s1.check(["agent/failures/0", "agent/restarts"])
        assert not s1.check(["agent/failures/1"])
        # multi_get: in order, a counter as its decimal text, b"" for a missing key (at
        # once: the agent's job watch polls keys that mostly do not exist).
        started = time.monotonic()
        keys = ["agent/failures/1", "agent/restarts", "agent/failures/0", "agent/never"]
        assert s1.multi_get(keys) == [b"", b"60", b'{"rank": 0}', b""]
        assert time.monotonic() - started < 5
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - each store has its own timeout type
            s1.wait(["agent/never"], timedelta(seconds=0.5))
        assert time.monotonic() - started < 10
        assert s0.delete_key("agent/failures/0")
        assert not s1.check(["agent/failures/0"])

    def test_a_wait_ticks_until_its_tick_gives_up(self, nodes: Nodes, run_id: str) -> None:
        """``wait`` calls its ``tick`` about every ``WAIT_TICK`` s while a key is missing,
        and what the tick raises ends the wait: how a node waiting for a round gives up
        (its store found lost) without a thread of its own. The store still answers."""
        infos = rendezvous_all(nodes.make(run_id, 2, 2, n=2))
        store = infos[1].store
        ticks: list[float] = []

        class GiveUp(Exception):
            pass

        def tick() -> None:
            ticks.append(time.monotonic())
            if len(ticks) == 2:
                raise GiveUp

        started = time.monotonic()
        with pytest.raises(GiveUp):
            store.wait(["agent/never"], timedelta(seconds=60), tick)
        assert 1.5 * WAIT_TICK <= time.monotonic() - started < 2 * WAIT_TICK + 5
        store.set("agent/after", b"1")
        assert store.get("agent/after") == b"1"
        store.wait(["agent/after"], timedelta(seconds=10), tick)  # there: no tick
        assert len(ticks) == 2

    def test_unknown_conf_key_rejected(self, rdzv_target: RendezvousTarget, run_id: str) -> None:
        params = rdzv_target.params(run_id, 1, 1, surely_not_a_key="1")
        with pytest.raises(RendezvousConfigError) as err:
            get_rendezvous_handler(params)
        assert "surely_not_a_key" in str(err.value) and "accepted" in str(err.value)

    def test_describe_is_read_only_and_names_the_members(
        self, nodes: Nodes, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        infos = rendezvous_all(nodes.make(run_id, 2, 2, n=2))
        viewer = get_rendezvous_handler(replace(rdzv_target.params(run_id, 1, 1), read_only=True))
        try:
            status = viewer.describe()
        except StatusNotSupportedError:
            pytest.skip(f"the {rdzv_target.backend} backend does not describe jobs")
        finally:
            viewer.shutdown()
        assert (status.run_id, status.backend, status.state) == (
            run_id,
            rdzv_target.backend,
            "running",
        )
        assert status.round == infos[0].round
        assert sorted(m.rank for m in status.members) == [0, 1]
        assert (status.min_nodes, status.max_nodes) == (2, 2)
        # Reading changed nothing: the members see no newcomer and no lost node.
        assert all(h.num_nodes_waiting() == 0 and not h.lost_nodes() for h in nodes.handlers)

    def test_describe_of_an_unknown_job_is_an_error(
        self, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        # Either answer is right: the backend cannot be reached for a job nobody started
        # (c10d: no agent hosts its store), or it is reached and knows no such job.
        with pytest.raises(RendezvousError):
            params = replace(rdzv_target.params(run_id, 1, 1), read_only=True)
            viewer = get_rendezvous_handler(params)
            try:
                viewer.describe()
            finally:
                viewer.shutdown()

    @staticmethod
    def _a_job_and_a_node_unlike_it(
        nodes: Nodes, rdzv_target: RendezvousTarget, run_id: str
    ) -> tuple[RendezvousHandler, RendezvousHandler]:
        """A running job of one node, and a second node made for it whose fingerprint
        differs in ``torch`` (made now: a node of this job, not a new job under its id)."""
        job = {field: "same" for field in FINGERPRINT_FIELDS}
        first = get_rendezvous_handler(replace(rdzv_target.params(run_id, 1, 2), fingerprint=job))
        nodes.handlers.append(first)
        first.next_rendezvous()
        other = get_rendezvous_handler(
            replace(rdzv_target.params(run_id, 1, 2), fingerprint={**job, "torch": "other"})
        )
        nodes.handlers.append(other)
        return first, other

    def test_mismatched_fingerprint_is_refused(
        self, nodes: Nodes, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        first, other = self._a_job_and_a_node_unlike_it(nodes, rdzv_target, run_id)
        with pytest.raises(RendezvousMismatchError) as refused:
            other.next_rendezvous()
        assert refused.value.fields == {"torch": ("same", "other")}
        assert first.num_nodes_waiting() == 0  # the running job never saw the refused node

    def test_a_closed_job_says_so_before_refusing_a_mismatch(
        self, nodes: Nodes, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        first, other = self._a_job_and_a_node_unlike_it(nodes, rdzv_target, run_id)
        time.sleep(0.05)
        first.set_closed()
        # The job is over: that is what the late node is told, not how it differs.
        with pytest.raises(RendezvousClosedError):
            other.next_rendezvous()

    # -- the membership rules every dynamic backend shares -------------------------------
    def test_stable_ranks_when_the_same_nodes_regroup(self, nodes: Nodes, run_id: str) -> None:
        handlers = nodes.make(run_id, 3, 3, n=3)
        first = rendezvous_all(handlers)
        again = rendezvous_all(handlers)
        assert_one_round(again, 3)
        assert again[0].round > first[0].round
        assert [i.rank for i in again] == [i.rank for i in first]

    def test_regroup_after_a_departure_skips_the_last_call(
        self, nodes: Nodes, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        slow = replace(rdzv_target, config={**rdzv_target.config, "last_call_timeout": "30"})
        handlers = Nodes(slow).make(run_id, 2, 3, n=3)
        nodes.handlers += handlers
        first = rendezvous_all(handlers)  # 3 of max 3: no last call
        leaver = handlers[-1]
        leaver.shutdown()  # the job is not closed: a departure
        survivors = handlers[:-1]
        assert wait_for(
            lambda: all(lost_nodes(h) for h in survivors), rdzv_target.detect_timeout
        ), "the survivors never saw the departure"
        started = time.monotonic()
        again = rendezvous_all(survivors, timeout=60)
        took = time.monotonic() - started
        assert_one_round(again, 2)
        assert again[0].round > first[0].round
        assert took < 15, f"the regroup waited {took:.1f}s: the last call (30 s) was not skipped"

    def test_departure_is_not_completion(
        self, nodes: Nodes, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        a, b, c = nodes.make(run_id, 2, 3, n=3)
        rendezvous_all([a, b, c])
        c.shutdown()  # leaves an open job: the others must see it, promptly
        departed_at = time.monotonic()
        assert wait_for(lambda: lost_nodes(a) and lost_nodes(b), rdzv_target.detect_timeout)
        assert time.monotonic() - departed_at < rdzv_target.detect_timeout
        assert a.membership_changed()
        rendezvous_all([a, b])
        a.set_closed()
        b.shutdown()  # the job is closed: finished, not lost
        time.sleep(min(3.0, rdzv_target.detect_timeout))
        assert a.lost_nodes() == []

    def test_peer_heartbeats_move_while_the_members_live(
        self, nodes: Nodes, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        """``peer_heartbeats`` (optional): every other member, each value new once its
        agent beat again; a departed member has none. A worker failure that names nothing
        stops waiting for a departure once every member beat since."""
        a, b, c = nodes.make(run_id, 3, 3, n=3)
        infos = rendezvous_all([a, b, c])
        first = a.peer_heartbeats()
        if first is None:
            pytest.skip("this backend cannot tell (peer_heartbeats answers None)")
        if infos[1].node_id:
            assert set(first) == {infos[1].node_id, infos[2].node_id}, first

        def moved() -> bool:
            now = a.peer_heartbeats() or {}
            return all(now.get(m) is not None and now.get(m) != v for m, v in first.items())

        assert wait_for(moved, rdzv_target.detect_timeout), (first, a.peer_heartbeats())
        c.shutdown()  # a departure: its heartbeat says so, and is no live beat
        if infos[2].node_id:
            gone = infos[2].node_id
            assert wait_for(lambda: (a.peer_heartbeats() or {}).get(gone, b"") is None, 10)

    def test_round_peers_are_the_other_members_as_lost_nodes_names_them(
        self, nodes: Nodes, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        """``round_peers`` (optional): the other members of the current round, named as
        ``lost_nodes`` names a member that leaves; the agent matches the two to tell a
        loss of its workers' peer from a joiner's."""
        a, b, c = nodes.make(run_id, 3, 3, n=3)
        infos = rendezvous_all([a, b, c])
        peers = a.round_peers()
        if peers is None:
            pytest.skip("this backend cannot tell (round_peers answers None)")
        assert len(peers) == 2 and infos[0].node_id not in peers, peers
        if infos[1].node_id:
            assert set(peers) == {infos[1].node_id, infos[2].node_id}, peers
        c.shutdown()  # a departure
        assert wait_for(lambda: lost_nodes(a), rdzv_target.detect_timeout)
        assert set(lost_nodes(a)) <= set(peers), (lost_nodes(a), peers)

    def test_out_of_range_config_is_rejected(
        self, rdzv_target: RendezvousTarget, run_id: str
    ) -> None:
        for bad in rdzv_target.bad_config:
            with pytest.raises(RendezvousConfigError) as err:
                get_rendezvous_handler(rdzv_target.params(run_id, 1, 1, **bad))
            (key,) = bad
            assert key in str(err.value), err.value
