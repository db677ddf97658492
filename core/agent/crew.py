"""The agent's workers room: start a round's workers, stop them (``crew`` of
``AgentBase``, ``base.py``).

Owns ``_start`` (log directories, the control file and the round's checkpoint coordinator,
the processes, the tee, the fence guard told what runs) and ``_stop`` (every worker's
process group, reaped; the tee stopped; never longer than a fencing's grace). Imports
core's workers room, the plugin host's hooks through ``AgentBase`` and this package's
``start``, ``checkpoint_on_notice`` helpers.
"""

from __future__ import annotations

from elastic.core.agent.base import AgentBase
from elastic.core.agent.checkpoint_on_notice import Coordinator, notice_env
from elastic.core.agent.start import place_group, start_workers
from elastic.core.interfaces.rendezvous import RendezvousInfo
from elastic.core.interfaces.spec import WorkerState
from elastic.core.workers.boot.sitecustomize import ENV_FILE as STACK_FILE_ENV
from elastic.core.workers.control_file import ControlFile
from elastic.core.workers.logs import LogLayout, start_tailer
from elastic.core.workers.process import stop_workers


class Crew(AgentBase):
    """This node's workers: started for a round, stopped."""

    def _start(self, info: RendezvousInfo, restarts: int) -> str | None:
        """Start this round's workers; an error line when they cannot all start."""
        spec, group = self._spec, self._group
        place_group(group, info, restarts)
        if info.node_id:
            self._node_id = info.node_id
        run_id = self._handler.get_run_id()
        try:
            if self._layout is None:
                self._layout = LogLayout.for_spec(run_id, spec, self._suffix)
            self._logs = self._layout.attempt(restarts, spec.local_world_size)
        except OSError as exc:
            return f"cannot create the log directory: {exc}"
        self._attempts += 1
        if self._coordinator is not None:  # each attempt starts with no request pending
            self._coordinator.control.close()
        control = ControlFile(spec.local_world_size)
        self._coordinator = Coordinator(info.store, info.round, control)

        def process_env(local_rank: int, error_file: str) -> dict[str, str]:
            env = self._host.worker_process_env(local_rank, error_file)
            # A plugin's dump file (the stall detector's) is also the one a regroup reads.
            return {**env, **control.worker_env(local_rank, env.get(STACK_FILE_ENV))}

        signals = {
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(self._signals),
            **notice_env(spec.preemption_signal, spec.preemption_grace, self._signals),
        }
        try:
            start_workers(
                group,
                self._logs,
                run_id=run_id,
                use_agent_store=self._handler.use_agent_store,
                extra_env={**signals, **spec.extra_env},
                process_env=process_env,
                started=self._workers,
                spares=self._spares,
            )
        except (OSError, ValueError) as exc:
            return f"cannot start worker {len(self._workers)}: {exc}"
        finally:
            self._tailer = start_tailer(
                spec.role,
                self._logs,
                attempt_dir=self._layout.attempt_dir,
                stdout_filters=spec.duplicate_stdout_filters,
                stderr_filters=spec.duplicate_stderr_filters,
            )
        group.state = WorkerState.HEALTHY
        if self._spares is not None:
            self._spares.refill_later()
        self._fence.watch(self._workers, info.round)
        self._notify("elastic_workers_started", group=group)
        return None

    def _stop(self, sig: int, timeout: float) -> None:
        """Stop every worker (their whole process groups), reap them, stop the tee."""
        timeout = self._fence.release(timeout)  # never longer than a fencing's grace
        if self._workers:
            if self._coordinator is not None:  # a signal from us ends them: never deferred
                self._coordinator.control.stopping()
            stop_workers(self._workers, sig, timeout)
        self._workers = []
        if self._tailer is not None:
            self._tailer.stop()
            self._tailer = None
        if self._group.state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY):
            self._group.state = WorkerState.STOPPED
