"""The agent's in-place regroup room: the job re-forms and this node keeps its workers
(``AgentBase``, ``base.py``).

Owns ``_regroup_in_place``: raise the regroup request, join the next round (skipping one
that lost a member while the nodes got ready), hand it to the running workers through the
control file and wait until they took it; workers that did not in time are restarted in
it. And ``_hand_to_starting``: workers still starting when the job re-forms are handed the
next round, which they take as they create their group, instead of being restarted.
The steps and their bounds live in ``regroup.py``; this room only orders them and
imports that module, ``checkpoint_on_notice``, ``start`` and ``restarts``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
from collections.abc import Iterator

from elastic.core.agent.base import AgentBase
from elastic.core.agent.checkpoint_on_notice import Coordinator, count_if_saved
from elastic.core.agent.fence import FENCE_GRACE
from elastic.core.agent.outcome import Outcome
from elastic.core.agent.regroup import (
    Untaken,
    announce_finished,
    announce_replaced,
    finished,
    finished_untaken,
    hand_over,
    left_out_a_peer,
    lost_a_peer,
    patience,
    replaced_in,
    round_superseded,
    untaken,
    wait_ready,
    wait_taken,
)
from elastic.core.agent.restarts import job_failed, restarts_used
from elastic.core.agent.start import place_group
from elastic.core.agent.store_call import store_call
from elastic.core.interfaces.rendezvous import RendezvousError, RendezvousInfo
from elastic.core.interfaces.spec import RunResult
from elastic.core.log import say


class InPlaceRegroup(AgentBase):
    """The same workers through a membership change."""

    def _hand_to_starting(self) -> tuple[RendezvousInfo, bool] | RunResult | None:
        """The job re-forms while our workers are still starting (``can_hand_to_starting``
        said so and requested the regroup): join the next round and hand it to them; each
        takes it as it creates its group (``elastic.init_process_group``), so their start-up
        is not thrown away. Returns the round to watch and whether this node counted itself
        ready for it (not yet: its workers will say so), or what ``_attempt`` returns."""
        info = self._next_round(kept=False)  # starting: their start-up is not over
        if not isinstance(info, RendezvousInfo):
            return info
        self._joining.attempt_started(info.store, info.round, self._calls)
        self._hand_round_over(info)
        return info, False

    def _next_round(
        self, kept: bool, waiting: bool = False, workers_round: int | None = None
    ) -> RendezvousInfo | RunResult | None:
        """The next round, or (its workers stopped) how the job ended meanwhile."""
        info = self._rendezvous(kept, waiting, workers_round)
        if isinstance(info, RunResult) or self._calls(job_failed, info.store):
            self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
            if isinstance(info, RunResult):
                return info
            return self._final_failure("the job failed on another node")
        return info

    def _hand_round_over(self, info: RendezvousInfo) -> tuple[int, int]:
        """Round ``info`` to our running workers through the control file; returns its
        generation and the restarts spent so far."""
        assert self._coordinator is not None
        control = self._coordinator.control
        restarts = self._calls(restarts_used, info.store)
        place_group(self._group, info, restarts)
        self._coordinator = Coordinator(info.store, info.round, control)
        generation = hand_over(
            control,
            self._group,
            self._workers,
            run_id=self._handler.get_run_id(),
            use_agent_store=self._handler.use_agent_store,
            error_files={r: logs.error_file for r, logs in self._logs.items()},
        )
        self._fence.watch(self._workers, info.round)
        return generation, restarts

    def _workers_peers(self) -> list[str] | None:
        """The other members of the round our workers run in (the handler's current one
        until the next rendezvous); None when the backend cannot tell or the store does
        not answer."""
        try:
            return self._calls(self._handler.round_peers)
        except RendezvousError:
            return None

    def _regroup_in_place(
        self, outcome: Outcome, peers: list[str] | None
    ) -> tuple[RendezvousInfo, bool] | RunResult | None:
        """The job re-forms and our workers can follow it (``core/agent/regroup.py``):
        join the next round and hand it to them; workers that do not take it in time are
        restarted in it. ``peers``: the other members of our workers' round. Returns the
        round to watch and whether this node counted itself ready for it (it did), or
        what ``_attempt`` returns.

        A preemption notice that comes meanwhile waits until our workers took the new
        round, half the grace at most (``_notice_waits``)."""
        with self._notice_waits():
            return self._regroup(outcome, peers)

    @contextlib.contextmanager
    def _notice_waits(self) -> Iterator[None]:
        """While the job re-forms, no group can save on request: the old one may have
        lost a member, the new one has not formed. A notice acted on then waits out its
        grace for a save that cannot come, and takes our workers away before the new
        round's new workers synced the state from them, the most tenured ranks: the only
        copy, when they hold the state alone (no checkpointer). So it waits, half the
        grace at most, until our workers took the new round; then the job saves in it,
        and this node leaves as on any notice (``signals.py``)."""
        control = self._coordinator.control if self._coordinator is not None else None
        grace = self._spec.preemption_grace
        if grace <= 0 or control is None or not control.listening():
            yield  # nobody would save on request: the notice is a departure at once
            return
        with self._guard.deferring(self._preempt_signum, grace / 2):
            yield

    def _regroup(
        self, outcome: Outcome, peers: list[str] | None
    ) -> tuple[RendezvousInfo, bool] | RunResult | None:
        assert self._coordinator is not None
        control = self._coordinator.control
        lost = outcome is not Outcome.MEMBERSHIP
        if lost:  # the old group lost a member: stop now
            control.request_regroup(lost=True)
        # Our workers cannot train until the new round: their group lost a member, or
        # broke under them (a peer's workers died: fenced, crashed) before anyone was lost.
        waiting = lost or control.broken()
        coordinator = self._coordinator

        def superseded(deferred: int) -> bool:  # asked every poll while a round gets ready
            store_call(count_if_saved, coordinator)
            return round_superseded(self._handler, deferred)

        while True:
            info = self._next_round(kept=True, waiting=waiting, workers_round=coordinator.round)
            if not isinstance(info, RendezvousInfo):
                return info
            if not waiting and left_out_a_peer(self._handler, info.deferred, peers):
                control.request_regroup(lost=True)
                waiting = True
            # Until every node's workers can join, ours train on in the old group if
            # they can; a round that lost a member meanwhile is skipped for the next.
            if wait_ready(
                info.store,
                info.round,
                info.world_size,
                self._workers,
                self._sleep,
                functools.partial(superseded, info.deferred),
            ):
                break
            if lost_a_peer(self._handler, peers):  # ours wait with it in vain
                control.request_regroup(lost=True)
                waiting = True
        if finished(self._workers, self._sleep):  # meanwhile, in the old round
            # The new round's new workers wait for a group that will not come: their
            # agents see the job finished and meet us at this round's exit barrier.
            announce_finished(info.store, info.round)
            return self._succeeded(info)
        control.request_regroup()  # every rank stops at one step boundary
        generation, restarts = self._hand_round_over(info)
        store, round_ = info.store, info.round

        def replaced() -> bool:
            try:
                return bool(self._calls(replaced_in, store, round_))
            except RendezvousError:
                return False  # cannot tell: the bound decides

        where: list[Untaken] = []

        def how_patient() -> float:
            where.append(untaken(control, generation, self._workers))
            return patience(where[0].waiting, first=info.rank == 0)

        taken = wait_taken(control, generation, self._workers, self._sleep, replaced, how_patient)
        # Also when the bound ran out: workers done in the old round are never restarted.
        if finished_untaken(control, generation, self._workers, self._sleep):
            announce_finished(info.store, info.round)  # as above, one step later
            return self._succeeded(info)
        if taken:
            self._notify("elastic_workers_started", group=self._group)
            return info, True
        with contextlib.suppress(RendezvousError):
            self._calls(announce_replaced, store, round_)
        why = where[0].explain() if where else "nor after another node restarted its workers"
        say(
            f"elastic: the workers did not take the new round in time ({why}); restarting them",
            logging.WARNING,
        )
        self._stop(signal.SIGTERM, FENCE_GRACE)  # stuck: their world is gone
        self._notify("elastic_restart", group=self._group, reason="regroup_timeout")
        error = self._start(info, restarts)
        if error is not None:
            self._stop(signal.SIGKILL, 0)
            return self._one_line_failure(error)
        return info, True
