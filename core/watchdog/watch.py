"""``WorkerWatch``: what the built-in watchdog plugins know about this agent's workers,
registered itself as the built-in plugin ``watchdog``.

It follows the agent through the same hooks as any plugin: it gives every worker a
progress file (``beats``) and, when stacks are wanted, a stack-dump path and the boot
directory (``stacks``); it tracks the workers of the running attempt and samples their
progress each monitor tick; it keeps the phase the health endpoint reports; and it adds
to failure records what the stall detector and the FileTimer server learnt. Its hooks
run first (``tryfirst``), so the other built-ins see this attempt's state; its
``elastic_run_end`` runs last, after they stopped using its files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic.core.plugin.hookspecs import hookimpl
from elastic.core.watchdog import stacks
from elastic.core.watchdog.beats import ENV_PROGRESS, ProgressFile, WorkerProgress

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord
    from elastic.core.interfaces.rendezvous import RendezvousInfo
    from elastic.core.interfaces.spec import RunResult, WorkerGroup
    from elastic.core.interfaces.store import Store
    from elastic.core.interfaces.worker_watch import WorkerHandle
    from elastic.core.watchdog.file_timer import FileTimerServer


class WorkerWatch:
    """One per agent. ``dumps``: give workers a stack-dump path (stalls, FileTimer)."""

    def __init__(self, *, timeout: float | None, dumps: bool, pythonpath: str | None) -> None:
        self.timeout = timeout  # --stall-timeout, for the health endpoint's readiness
        self._dumps_on = dumps
        self._pythonpath = pythonpath
        self._dir: str | None = None
        self._seq = 0  # rendezvous rounds seen: names this attempt's files
        self._files: dict[int, ProgressFile] = {}
        self.stack_files: dict[int, str] = {}
        self.tracked: dict[int, WorkerProgress] = {}
        self._pgids: dict[int, int] = {}  # worker pid (= its process group) -> local rank
        self.info: dict[int, dict[str, Any]] = {}  # local rank -> what annotate adds
        self.dumps: dict[int, str] = {}  # local rank -> its rendered stacks
        self.phase = "starting"
        self.store: Store | None = None
        self.round = 0
        self.nodes = 1
        self.stalls = 0
        self.restart_count = 0
        self.timers: FileTimerServer | None = None  # set by the FileTimer built-in

    def directory(self) -> str:
        """This agent's scratch directory (progress files, default dump paths, the pipe)."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="elastic-watch-")
        return self._dir

    # --- the agent's lifecycle ------------------------------------------------------------
    @hookimpl(tryfirst=True)
    def elastic_agent_start(self) -> None:
        self.phase = "waiting for rendezvous"

    @hookimpl(tryfirst=True)
    def elastic_rendezvous_complete(self, info: RendezvousInfo) -> None:
        self.store, self.round, self.nodes = info.store, info.round, info.world_size
        self._seq += 1
        self.phase = f"starting workers (round {info.round})"

    @hookimpl(tryfirst=True)
    def elastic_worker_process_env(self, local_rank: int, error_file: str) -> dict[str, str]:
        """The worker's progress file; with dumps on, its stack file (next to its error
        file) and the boot path that makes it answer dump requests."""
        old = self._files.pop(local_rank, None)
        if old is not None:
            old.close()
        name = f"{self._seq}-{local_rank}"
        self._files[local_rank] = ProgressFile(os.path.join(self.directory(), f"progress-{name}"))
        env = {ENV_PROGRESS: self._files[local_rank].path}
        if self._dumps_on:
            rank_dir = os.path.dirname(error_file) if error_file else ""
            path = os.path.join(rank_dir, "stacks.txt") if rank_dir else ""
            path = path or os.path.join(self.directory(), f"stacks-{name}")
            with contextlib.suppress(OSError):
                os.unlink(path)
            self.stack_files[local_rank] = path
            env.update(stacks.worker_env(path, self._pythonpath))
        return env

    @hookimpl(tryfirst=True)
    def elastic_workers_started(self, group: WorkerGroup) -> None:
        mono = time.monotonic()
        self.restart_count = group.restart_count
        self.info, self.dumps, self._pgids = {}, {}, {}
        tracked = {}
        for w in group.workers:
            if w.pid is not None:
                tracked[w.local_rank] = WorkerProgress(w.local_rank, w.global_rank, w.pid, mono)
                tracked[w.local_rank].file = self._files.get(w.local_rank)
                self._pgids[w.pid] = w.local_rank
        self.tracked = tracked
        self.phase = "running"

    @hookimpl(tryfirst=True)
    def elastic_check_workers(self, workers: Sequence[WorkerHandle]) -> None:
        """Sample every worker's progress (the others read it); never a verdict."""
        mono = time.monotonic()
        for progress in list(self.tracked.values()):
            progress.sample(mono)

    @hookimpl(tryfirst=True)
    def elastic_annotate_failures(self, records: list[FailureRecord]) -> None:
        """Add what this attempt learnt (stall, expired timer, stacks) to the records."""
        for record in records:
            info = self.info.get(record.local_rank, {})
            if "stall" in info:
                record.extra["stall"] = info["stall"]
                record.message = info["message"]
            if "file_timer" in info:
                record.extra["file_timer"] = info["file_timer"]
                own = f" ({record.message})" if record.message else ""
                record.message = info["message"] + own
            if self.dumps.get(record.local_rank):
                record.extra["stacks"] = self.dumps[record.local_rank]

    @hookimpl(tryfirst=True)
    def elastic_worker_failed(self) -> None:
        self.phase = "a worker failed: stopping the workers"

    @hookimpl(tryfirst=True)
    def elastic_restart(self, reason: str) -> None:
        self.tracked = {}
        self.phase = f"restarting ({reason}): waiting for rendezvous"

    @hookimpl(trylast=True)
    def elastic_run_end(self, result: RunResult) -> None:
        self.tracked = {}
        self.phase = "finished: failed" if result.is_failed() else "finished"
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # --- for the other built-ins ------------------------------------------------------------
    def owner(self, pid: int) -> int | None:
        """The local rank of the worker whose process group ``pid`` is in."""
        try:
            return self._pgids.get(os.getpgid(pid))
        except OSError:
            return None

    def armed_ranks(self) -> set[int]:
        """Workers with an armed FileTimer: their own deadline governs them."""
        if self.timers is None:
            return set()
        return {r for pid in self.timers.armed() if (r := self.owner(pid)) is not None}

    def local_progress(self) -> float:
        """Monotonic time of this node's latest worker progress."""
        return max((p.last_progress for p in list(self.tracked.values())), default=0.0)

    def dump(self, ranks: dict[int, int], wait: float = stacks.DUMP_WAIT) -> dict[int, Any]:
        """Dump the stacks of ``ranks`` (local rank -> pid) that have a dump file, and keep
        each rendering for the failure records."""
        files = self.stack_files
        found = stacks.dump_stacks(
            {r: (pid, files[r]) for r, pid in ranks.items() if r in files}, wait
        )
        for rank, dump in found.items():
            self.dumps[rank] = dump.render()
        return found
