"""``TORCHELASTIC_ENABLE_FILE_TIMER=1``: the built-in plugin ``file-timer``, which runs
the FileTimer server (``file_timer``) for this agent's workers.

A request counts as progress for the stall detector; a worker with an armed timer is
governed by its own deadline, not by ``--stall-timeout``; an expired timer is said on
stderr, the worker's stacks are dumped, and its failure record names the scope.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from elastic.core.log import say
from elastic.core.plugin.hookspecs import hookimpl
from elastic.core.watchdog import file_timer

if TYPE_CHECKING:
    from elastic.core.watchdog.watch import WorkerWatch


class FileTimerWatch:
    """``path``: the pipe named by ``TORCHELASTIC_TIMER_FILE``, else one of our own."""

    def __init__(self, watch: WorkerWatch, path: str | None) -> None:
        self.watch = watch
        self._path = path
        self.server: file_timer.FileTimerServer | None = None

    @hookimpl
    def elastic_agent_start(self) -> None:
        path = self._path or os.path.join(self.watch.directory(), "watchdog_timer")
        self.server = file_timer.FileTimerServer(
            path, owns=self._owns, on_request=self._request, on_expired=self._expired
        ).start()
        self.watch.timers = self.server

    @hookimpl
    def elastic_worker_process_env(self) -> dict[str, str] | None:
        return {file_timer.ENV_FILE: self.server.path} if self.server is not None else None

    @hookimpl
    def elastic_workers_started(self) -> None:
        if self.server is not None:
            self.server.clear()  # a new attempt's workers start with no timer

    @hookimpl
    def elastic_run_end(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = self.watch.timers = None

    def _owns(self, pid: int) -> bool:
        return self.watch.owner(pid) is not None

    def _request(self, req: file_timer.TimerRequest) -> None:
        rank = self.watch.owner(req.pid)
        progress = self.watch.tracked.get(rank) if rank is not None else None
        if progress is not None:
            progress.note("timer")

    def _expired(self, req: file_timer.TimerRequest, scopes: list[str]) -> None:
        """Before the server signals an expired timer's process: say so, dump its stack."""
        rank = self.watch.owner(req.pid)
        progress = self.watch.tracked.get(rank) if rank is not None else None
        if rank is None or progress is None:
            return
        name = signal_name(req.signal)
        say(
            f"elastic: FileTimer scope {req.scope_id!r} of worker rank {progress.rank} "
            f"(pid {req.pid}) expired {time.time() - req.expiration_time:.1f}s ago; "
            f"sending it {name}",
            logging.WARNING,
        )
        self.watch.dump({rank: progress.pid}, wait=0.5)
        self.watch.info.setdefault(rank, {}).update(
            file_timer={
                "scope": req.scope_id,
                "expired_scopes": scopes,
                "expiration_time": req.expiration_time,
                "signal": name,
                "pid": req.pid,
            },
            message=f"FileTimer scope {req.scope_id!r} expired; the agent sent {name} to it",
        )


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
