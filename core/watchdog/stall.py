"""``--stall-timeout``: the built-in plugin ``stall``, which answers
``elastic_check_workers`` when this node's workers hang.

**A stall.** A live worker with no armed FileTimer that made no progress
(``beats``: heartbeats, timer requests, else CPU time) for ``--stall-timeout``
seconds is a candidate; its Python stack (``stacks``) says whether it is
**waiting in a collective**. A candidate that is not waiting is stalled at once. A
waiting one is stalled only when nothing else progressed for the timeout either, on this
node or, through the store, on any other (``job_channel``): a rank waiting in
``init_process_group`` for a peer that is still importing torch is not a hang.

**Then**, within the timeout plus a monitor interval plus a CPU sample (plus
``NO_ANSWER_GRACE`` for a worker that does not answer its dump), the agent
(1) tells the other agents (``agent/stall/<round>``), (2) dumps the stacks of every thread
of every local worker, (3) waits until every agent has dumped its own (at most
``PEER_WAIT``), (4) SIGKILLs the stalled workers and those idle for ``PEER_IDLE`` s, and
hands them to the agent as failed: failure records with the stacks and the stall in
``extra``, one claimed restart of the job-wide budget, like a crash. A record's time is
when its worker's progress stopped, so the root cause is the rank that stopped first;
ranks waiting in a collective come after every other one (``failures.summarize``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic.core.interfaces.worker_watch import WorkerVerdict
from elastic.core.log import say
from elastic.core.plugin.hookspecs import hookimpl
from elastic.core.watchdog import stacks
from elastic.core.watchdog.beats import WorkerProgress
from elastic.core.watchdog.job_channel import QUOTA, JobStallChannel

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord
    from elastic.core.interfaces.worker_watch import WorkerHandle
    from elastic.core.watchdog.watch import WorkerWatch

PEER_IDLE = 1.0  # a worker idle this long when a stall is found is reported with it
# A registered worker that does not answer a dump, or answers with no Python frame in its
# main thread, is either exiting (the interpreter's shutdown unregisters faulthandler's
# handlers, and before that its main thread runs no Python) or truly stuck (stopped, in D
# state, or the script took the signal): it is blamed only once it has neither answered
# nor exited for this long, so a worker on its way out is not taken for a hung one.
NO_ANSWER_GRACE = 2.0
PEER_FAILED = WorkerVerdict()  # another node's stall ends this attempt


class StallDetector:
    """One per agent with ``--stall-timeout``; reads and writes the shared ``WorkerWatch``."""

    def __init__(self, watch: WorkerWatch, timeout: float) -> None:
        self.watch = watch
        self.timeout = timeout
        self._waiting: dict[int, tuple[float, bool]] = {}  # rank -> (classified at, waiting)
        self._unanswered: dict[int, float] = {}  # rank -> when it first did not answer a dump
        self._job: JobStallChannel | None = None
        self._unpublished: set[int] | None = None  # stall records the agent has yet to publish

    # --- hooks ------------------------------------------------------------------------------
    @hookimpl
    def elastic_workers_started(self) -> None:
        self._waiting, self._unanswered, self._unpublished = {}, {}, None
        w = self.watch
        if w.nodes > 1 and w.store is not None:
            self._job = JobStallChannel(w.store, w.round, w.nodes, self.timeout, w.local_progress)

    @hookimpl
    def elastic_check_workers(self, workers: Sequence[WorkerHandle]) -> WorkerVerdict | None:
        """A verdict when this node must report a stall (its ``failed``: local rank ->
        (exit code, time its progress stopped)), or when another node's stall ends this
        attempt (nothing failed here); else None."""
        tracked = self.watch.tracked
        if not tracked:
            return None
        mono = time.monotonic()
        alive = {w.local_rank: w for w in workers if w.poll() is None}
        if self._job is not None and self._job.peer_stall.is_set():
            return self._report(alive, mono, [], found_here=False)
        armed = self.watch.armed_ranks()
        candidates = [
            p
            for r, p in tracked.items()
            if r in alive and r not in armed and p.idle(mono) >= self.timeout
        ]
        if not candidates:
            return None
        waiting = {p.local_rank: self._is_waiting(p, alive[p.local_rank].pid) for p in candidates}
        candidates = [p for p in candidates if waiting[p.local_rank] is not None]
        if not candidates:
            return None
        culprits = [p for p in candidates if not waiting[p.local_rank]]
        if culprits:
            return self._report(alive, mono, culprits, found_here=True)
        last = max(p.last_progress for p in tracked.values())
        if self._job is not None:
            last = max(last, self._job.job_progress)
        if mono - last >= self.timeout:  # everyone waits: a deadlock, or a peer died mute
            return self._report(alive, mono, candidates, found_here=True)
        return None

    @hookimpl
    def elastic_worker_failed(self, record: FailureRecord) -> None:
        """Its record was just published: once all of ours are, tell the other agents."""
        pending = self._unpublished
        if pending is not None:
            pending.discard(record.local_rank)
        if pending == set() and self._job is not None:
            self._unpublished = None
            self._job.published()

    @hookimpl
    def elastic_restart(self) -> None:
        self._stop_channel()

    @hookimpl
    def elastic_run_end(self) -> None:
        self._stop_channel()

    def _stop_channel(self) -> None:
        if self._job is not None:
            self._job.stop()
            self._job = None

    def _is_waiting(self, p: WorkerProgress, pid: int) -> bool | None:
        """Whether ``p``'s main thread waits in a collective, from a fresh dump when the
        last one is older than its progress or than a quarter of the timeout. None (not a
        candidate yet; asked again each check) while it has not answered for less than
        ``NO_ANSWER_GRACE``; after that it is not waiting."""
        at, waiting = self._waiting.get(p.local_rank, (-1.0, False))
        mono = time.monotonic()
        stale = at < p.last_progress or mono - at > min(max((self.timeout or 4) / 4, 1.0), 10.0)
        if stale and p.local_rank in self.watch.stack_files:
            target = {p.local_rank: (pid, self.watch.stack_files[p.local_rank])}
            dump = stacks.dump_stacks(target, wait=0.5).get(p.local_rank)
            main = dump.main if dump is not None else None
            if main is None or not main.frames:  # no answer, or no Python frame: exiting
                first = self._unanswered.setdefault(p.local_rank, mono)
                return None if mono - first < NO_ANSWER_GRACE else False
            self._unanswered.pop(p.local_rank, None)
            waiting = dump.waiting_in() is not None
            self._waiting[p.local_rank] = (mono, waiting)
        return waiting

    # --- a stall ----------------------------------------------------------------------------
    def _report(
        self,
        alive: dict[int, WorkerHandle],
        mono: float,
        stalled: list[WorkerProgress],
        found_here: bool,
    ) -> WorkerVerdict:
        self.watch.stalls += 1
        detected_at = time.time()
        if found_here:
            first = min(stalled, key=lambda p: p.last_progress_wall)
            idle = first.idle(mono)
            self.watch.phase = f"stalled: worker rank {first.rank} made no progress for {idle:.1f}s"
            say(
                f"elastic: stall: worker rank {first.rank} (local rank {first.local_rank}) made "
                f"no progress for {idle:.1f}s (--stall-timeout {self.timeout:g}, last seen "
                f"through {first.source}); dumping stacks, then restarting",
                logging.WARNING,
            )
            if self._job is not None:
                self._job.announce([p.rank for p in stalled], detected_at)
        else:
            self.watch.phase = "stalled on another node: dumping stacks, then restarting"
            say("elastic: stall found on another node; dumping stacks", logging.WARNING)
        dumps = self.watch.dump({r: w.pid for r, w in alive.items()})
        idle = [
            p for r, p in self.watch.tracked.items() if r in alive and p.idle(mono) >= PEER_IDLE
        ]
        chosen = self._within_quota(stalled, idle, dumps)
        for p in chosen:
            self._describe(p, dumps.get(p.local_rank), mono, detected_at, found_here)
        self._unpublished = {p.local_rank for p in chosen}
        if self._job is not None:
            if chosen:
                self._job.will_report()
            self._job.dumped(wait=found_here)
        if not chosen:
            return PEER_FAILED
        for p in chosen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(
            alive[p.local_rank].poll() is None for p in chosen
        ):
            time.sleep(0.01)
        failed = {}
        for p in chosen:
            code = alive[p.local_rank].poll()
            failed[p.local_rank] = (-signal.SIGKILL if code is None else code, p.last_progress_wall)
        return WorkerVerdict(failed)

    def _within_quota(
        self, stalled: list[WorkerProgress], idle: list[WorkerProgress], dumps: dict[int, Any]
    ) -> list[WorkerProgress]:
        """The stalled and idle workers within the job-wide record quota, the earliest
        stopped first; a finder always reports its first stalled worker."""
        picked: list[WorkerProgress] = []
        candidates = list({p.local_rank: p for p in [*stalled, *idle]}.values())
        for kind in ("culprit", "waiter"):
            group = sorted(
                (p for p in candidates if (kind == "waiter") == _waits(dumps.get(p.local_rank))),
                key=lambda p: p.last_progress_wall,
            )
            if group:
                allowed = self._job.quota(kind, len(group)) if self._job else QUOTA[kind]
                picked += group[:allowed]
        if stalled and not any(p in picked for p in stalled):
            picked.append(min(stalled, key=lambda p: p.last_progress_wall))
        return picked

    def _describe(
        self, p: WorkerProgress, dump: Any, mono: float, detected_at: float, found_here: bool
    ) -> None:
        idle = p.idle(mono)
        waiting = dump.waiting_in() if dump is not None else None
        where = dump.where() if dump is not None else "<no stack: the worker did not answer>"
        self.watch.info.setdefault(p.local_rank, {}).update(
            stall={
                "timeout": self.timeout,
                "idle_seconds": round(idle, 3),
                "last_progress": p.last_progress_wall,
                "source": p.source,
                "heartbeats": p.beats,
                "detected_at": detected_at,
                "found_on_this_node": found_here,
                "waiting": waiting,
                "where": where,
            },
            message=f"stalled: no progress for {idle:.1f}s (--stall-timeout {self.timeout:g}); "
            + (
                f"waiting in a collective at {waiting} for a peer that never came"
                if waiting
                else f"stuck at {where}"
            ),
        )


def _waits(dump: Any) -> bool:
    return dump is not None and dump.waiting_in() is not None
