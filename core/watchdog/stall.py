"""The hang watchdog: ``--stall-timeout``, the FileTimer server and ``--health-port``,
behind the few calls the agent makes (``worker_env``, ``on_event``, ``check``,
``annotate``, ``close``).

**A stall.** A live worker with no armed FileTimer that made no progress
(``core/watchdog/beats.py``: heartbeats, timer requests, else CPU time) for ``--stall-timeout``
seconds is a candidate; its Python stack (``core/watchdog/stacks.py``) says whether it is
**waiting in a collective**. A candidate that is not waiting is stalled at once. A
waiting one is stalled only when nothing else progressed for the timeout either, on this
node or, through the store, on any other (``core/watchdog/job_channel.py``): a rank waiting in
``init_process_group`` for a peer that is still importing torch is not a hang.

**Then**, within the timeout plus a monitor interval plus a CPU sample, the agent
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
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from elastic.core.watchdog import file_timer, health, stacks
from elastic.core.watchdog.beats import ENV_PROGRESS, ProgressFile, WorkerProgress
from elastic.core.watchdog.job_channel import QUOTA, JobStallChannel

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord
    from elastic.core.interfaces.spec import WorkerSpec
    from elastic.core.interfaces.store import Store
    from elastic.core.workers.process import WorkerProcess

PEER_IDLE = 1.0  # a worker idle this long when a stall is found is reported with it
Outcome = tuple[str, dict[int, tuple[int, float]]]  # what the agent's monitor returns


class StallWatchdog:
    """One per agent. Inert (no env, no thread, no file) unless a feature is on."""

    def __init__(self, spec: WorkerSpec, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.timeout: float | None = spec.stall_timeout
        self.file_timer = env.get(file_timer.ENV_ENABLE) == "1"
        self._timer_path = env.get(file_timer.ENV_FILE)
        self._pythonpath = spec.extra_env.get("PYTHONPATH", env.get("PYTHONPATH"))
        self.enabled = bool(self.timeout or spec.health_port is not None or self.file_timer)
        self._dumps_on = bool(self.timeout or self.file_timer)
        self._dir: str | None = None
        self._seq = 0  # rendezvous rounds seen: names this attempt's files
        self._files: dict[int, ProgressFile] = {}
        self._stack_files: dict[int, str] = {}
        self.tracked: dict[int, WorkerProgress] = {}
        self._pgids: dict[int, int] = {}  # worker pid (= its process group) -> local rank
        self._waiting: dict[int, tuple[float, bool]] = {}  # rank -> (classified at, waiting)
        self._info: dict[int, dict[str, Any]] = {}  # local rank -> what annotate adds
        self._dumps: dict[int, str] = {}
        self.phase = "starting"
        self._store: Store | None = None
        self.round = 0
        self._nodes = 1
        self._job: JobStallChannel | None = None
        self._unpublished: set[int] | None = None  # stall records the agent has yet to publish
        self.stalls = 0
        self.restart_count = 0
        self.timers: file_timer.FileTimerServer | None = None
        port = spec.health_port
        self.health = health.serve(port, self) if port is not None else None

    # --- the agent's calls --------------------------------------------------------------
    def worker_env(self, local_rank: int, error_file: str) -> dict[str, str]:
        """Variables for one worker of the attempt being started: its progress file, its
        stack dump file (next to its error file) and boot path, the FileTimer pipe."""
        if not self.enabled:
            return {}
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="elastic-watch-")
        old = self._files.pop(local_rank, None)
        if old is not None:
            old.close()
        name = f"{self._seq}-{local_rank}"
        self._files[local_rank] = ProgressFile(os.path.join(self._dir, f"progress-{name}"))
        env = {ENV_PROGRESS: self._files[local_rank].path}
        if self._dumps_on:
            rank_dir = os.path.dirname(error_file) if error_file else ""
            path = os.path.join(rank_dir, "stacks.txt") if rank_dir else ""
            path = path or os.path.join(self._dir, f"stacks-{name}")
            with contextlib.suppress(OSError):
                os.unlink(path)
            self._stack_files[local_rank] = path
            env.update(stacks.worker_env(path, self._pythonpath))
        if self.timers is not None:
            env[file_timer.ENV_FILE] = self.timers.path
        return env

    def on_event(self, hook: str, kwargs: dict[str, Any]) -> None:
        """The agent's lifecycle (its plugin hooks) drives the phase and the attempts."""
        if not self.enabled:
            return
        if hook == "elastic_agent_start":
            self.phase = "waiting for rendezvous"
            if self.health is not None:
                self.health.start()
            if self.file_timer and self.timers is None:
                self._start_timer_server()
        elif hook == "elastic_rendezvous_complete":
            info = kwargs["info"]
            self._store, self.round, self._nodes = info.store, info.round, info.world_size
            self._seq += 1
            self.phase = f"starting workers (round {info.round})"
        elif hook == "elastic_workers_started":
            self._start_attempt(kwargs["group"])
        elif hook == "elastic_worker_failed":  # its record was just published
            self.phase = "a worker failed: stopping the workers"
            pending = self._unpublished
            if pending is not None:
                pending.discard(kwargs["record"].local_rank)
            if pending == set() and self._job is not None:
                self._unpublished = None
                self._job.published()
        elif hook == "elastic_restart":
            self._end_attempt()
            self.phase = f"restarting ({kwargs.get('reason')}): waiting for rendezvous"
        elif hook == "elastic_run_end":
            self._end_attempt()
            result = kwargs.get("result")
            self.phase = (
                "finished: failed" if result is not None and result.is_failed() else "finished"
            )

    def check(self, workers: list[WorkerProcess]) -> Outcome | None:
        """Sample progress; ``("stalled", failed)`` when this node must report a stall
        (``failed``: local rank -> (exit code, time its progress stopped)),
        ``("peer_failed", {})`` when another node's stall ends this attempt, else None."""
        if not self.tracked:
            return None
        mono = time.monotonic()
        for progress in list(self.tracked.values()):
            progress.sample(mono)
        if not self.timeout:
            return None
        alive = {w.local_rank: w for w in workers if w.poll() is None}
        if self._job is not None and self._job.peer_stall.is_set():
            return self._report(alive, mono, [], found_here=False)
        armed = self._armed_ranks()
        candidates = [
            p
            for r, p in self.tracked.items()
            if r in alive and r not in armed and p.idle(mono) >= self.timeout
        ]
        if not candidates:
            return None
        culprits = [p for p in candidates if not self._is_waiting(p, alive[p.local_rank].pid)]
        if culprits:
            return self._report(alive, mono, culprits, found_here=True)
        last = max(p.last_progress for p in self.tracked.values())
        if self._job is not None:
            last = max(last, self._job.job_progress)
        if mono - last >= self.timeout:  # everyone waits: a deadlock, or a peer died mute
            return self._report(alive, mono, candidates, found_here=True)
        return None

    def annotate(self, records: list[FailureRecord]) -> None:
        """Add what this attempt learnt (stall, expired timer, stacks) to the records."""
        for record in records:
            info = self._info.get(record.local_rank, {})
            if "stall" in info:
                record.extra["stall"] = info["stall"]
                record.message = info["message"]
            if "file_timer" in info:
                record.extra["file_timer"] = info["file_timer"]
                own = f" ({record.message})" if record.message else ""
                record.message = info["message"] + own
            if self._dumps.get(record.local_rank):
                record.extra["stacks"] = self._dumps[record.local_rank]

    def close(self) -> None:
        self._end_attempt()
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self.timers is not None:
            self.timers.stop()
            self.timers = None
        if self.health is not None:
            self.health.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # --- attempts -------------------------------------------------------------------------
    def _start_attempt(self, group: Any) -> None:
        mono = time.monotonic()
        self.restart_count = group.restart_count
        self._info, self._dumps, self._pgids, self._waiting = {}, {}, {}, {}
        self._unpublished = None
        tracked = {}
        for w in group.workers:
            if w.pid is not None:
                tracked[w.local_rank] = WorkerProgress(w.local_rank, w.global_rank, w.pid, mono)
                tracked[w.local_rank].file = self._files.get(w.local_rank)
                self._pgids[w.pid] = w.local_rank
        self.tracked = tracked
        if self.timers is not None:
            self.timers.clear()
        self.phase = "running"
        if self.timeout and self._nodes > 1 and self._store is not None:
            self._job = JobStallChannel(
                self._store, self.round, self._nodes, self.timeout, self._local_progress
            )

    def _end_attempt(self) -> None:
        if self._job is not None:
            self._job.stop()
            self._job = None
        self.tracked = {}

    def _local_progress(self) -> float:
        return max((p.last_progress for p in list(self.tracked.values())), default=0.0)

    def _is_waiting(self, p: WorkerProgress, pid: int) -> bool:
        """Whether ``p``'s main thread waits in a collective, from a fresh dump when the
        last one is older than its progress or than a quarter of the timeout."""
        at, waiting = self._waiting.get(p.local_rank, (-1.0, False))
        mono = time.monotonic()
        stale = at < p.last_progress or mono - at > min(max((self.timeout or 4) / 4, 1.0), 10.0)
        if stale and p.local_rank in self._stack_files:
            target = {p.local_rank: (pid, self._stack_files[p.local_rank])}
            dump = stacks.dump_stacks(target, wait=0.5).get(p.local_rank)
            waiting = dump is not None and dump.waiting_in() is not None
            self._waiting[p.local_rank] = (mono, waiting)
        return waiting

    # --- a stall ----------------------------------------------------------------------------
    def _report(
        self,
        alive: dict[int, WorkerProcess],
        mono: float,
        stalled: list[WorkerProgress],
        found_here: bool,
    ) -> Outcome:
        self.stalls += 1
        detected_at = time.time()
        if found_here:
            first = min(stalled, key=lambda p: p.last_progress_wall)
            idle = first.idle(mono)
            self.phase = f"stalled: worker rank {first.rank} made no progress for {idle:.1f}s"
            print(
                f"elastic: stall: worker rank {first.rank} (local rank {first.local_rank}) made "
                f"no progress for {idle:.1f}s (--stall-timeout {self.timeout:g}, last seen "
                f"through {first.source}); dumping stacks, then restarting",
                file=sys.stderr,
                flush=True,
            )
            if self._job is not None:
                self._job.announce([p.rank for p in stalled], detected_at)
        else:
            self.phase = "stalled on another node: dumping stacks, then restarting"
            print("elastic: stall found on another node; dumping stacks", file=sys.stderr)
        files = self._stack_files
        dumps = stacks.dump_stacks({r: (w.pid, files[r]) for r, w in alive.items() if r in files})
        for r, dump in dumps.items():
            self._dumps[r] = dump.render()
        idle = [p for r, p in self.tracked.items() if r in alive and p.idle(mono) >= PEER_IDLE]
        chosen = self._within_quota(stalled, idle, dumps)
        for p in chosen:
            self._describe(p, dumps.get(p.local_rank), mono, detected_at, found_here)
        self._unpublished = {p.local_rank for p in chosen}
        if self._job is not None:
            if chosen:
                self._job.will_report()
            self._job.dumped(wait=found_here)
        if not chosen:
            return "peer_failed", {}
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
        return "stalled", failed

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
        self._info.setdefault(p.local_rank, {}).update(
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

    # --- FileTimer ----------------------------------------------------------------------------
    def _start_timer_server(self) -> None:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="elastic-watch-")
        path = self._timer_path or os.path.join(self._dir, "watchdog_timer")
        self.timers = file_timer.FileTimerServer(
            path, owns=self._owns, on_request=self._timer_request, on_expired=self._expired
        ).start()

    def _owner(self, pid: int) -> int | None:
        """The local rank of the worker whose process group ``pid`` is in."""
        try:
            return self._pgids.get(os.getpgid(pid))
        except OSError:
            return None

    def _owns(self, pid: int) -> bool:
        return self._owner(pid) is not None

    def _armed_ranks(self) -> set[int]:
        if self.timers is None:
            return set()
        return {r for pid in self.timers.armed() if (r := self._owner(pid)) is not None}

    def _timer_request(self, req: file_timer.TimerRequest) -> None:
        rank = self._owner(req.pid)
        progress = self.tracked.get(rank) if rank is not None else None
        if progress is not None:
            progress.note("timer")

    def _expired(self, req: file_timer.TimerRequest, scopes: list[str]) -> None:
        """Before the server signals an expired timer's process: say so, dump its stack."""
        rank = self._owner(req.pid)
        progress = self.tracked.get(rank) if rank is not None else None
        if rank is None or progress is None:
            return
        name = _signame(req.signal)
        print(
            f"elastic: FileTimer scope {req.scope_id!r} of worker rank {progress.rank} "
            f"(pid {req.pid}) expired {time.time() - req.expiration_time:.1f}s ago; "
            f"sending it {name}",
            file=sys.stderr,
            flush=True,
        )
        if rank in self._stack_files:
            dumps = stacks.dump_stacks({rank: (progress.pid, self._stack_files[rank])}, wait=0.5)
            if rank in dumps:
                self._dumps[rank] = dumps[rank].render()
        self._info.setdefault(rank, {}).update(
            file_timer={
                "scope": req.scope_id,
                "expired_scopes": scopes,
                "expiration_time": req.expiration_time,
                "signal": name,
                "pid": req.pid,
            },
            message=f"FileTimer scope {req.scope_id!r} expired; the agent sent {name} to it",
        )


def _waits(dump: Any) -> bool:
    return dump is not None and dump.waiting_in() is not None


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
