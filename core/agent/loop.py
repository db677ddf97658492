"""The node agent: rendezvous, start this node's workers, watch them, decide; again.

One loop per node. Each round the agent rendezvouses, starts its workers with torchrun's
environment, watches them (``monitor``) until something ends the attempt, and decides:
success waits at the exit barrier (``exit_barrier``); a local failure is recorded and
costs one restart of the job-wide budget, or ends the job (``failure``, ``restarts``),
unless a departing node caused it (``departure``); a node arriving or leaving re-forms
the group for free, and workers that can regroup in place keep running through it
(``regroup``: the new round handed to them through the control file). Signals sent to
the agent are forwarded to every worker's process group, and the agent exits with
``128 + signum`` once they are gone; a preemption notice first has the job checkpoint
(``checkpoint_on_notice``).

The hang watchdog, the FileTimer server and the health endpoint are built-in plugins
(``elastic.core.watchdog.builtin``) on the agent's plugin host, called through the same
hooks as anyone's. The agent never imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import socket
import time
import uuid
from collections.abc import Callable

from elastic.core.agent.checkpoint_on_notice import (
    Coordinator,
    checkpoint_before_leaving,
    notice_env,
)
from elastic.core.agent.departure import departure_caused
from elastic.core.agent.exit_barrier import exit_barrier
from elastic.core.agent.exit_code import JobEnd, after_barrier, after_close, exit_code
from elastic.core.agent.failure import failure_records, publish_and_decide, report_failure
from elastic.core.agent.fence import FenceGuard
from elastic.core.agent.job_watch import JobWatch
from elastic.core.agent.joining import Joining, leave_alone
from elastic.core.agent.monitor import watch_attempt
from elastic.core.agent.outcome import AttemptEnd, Outcome
from elastic.core.agent.regroup import (
    RoundWatch,
    announce_finished,
    announce_replaced,
    can_regroup,
    finished,
    finished_untaken,
    hand_over,
    replaced_in,
    wait_ready,
    wait_taken,
)
from elastic.core.agent.restarts import job_failed, restarts_used
from elastic.core.agent.start import place_group, start_workers
from elastic.core.agent.store_call import BoundedCalls
from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.agent import ElasticAgent
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousFencedError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousMismatchError,
    RendezvousStoreMovedError,
)
from elastic.core.interfaces.spec import RunResult, WorkerGroup, WorkerSpec, WorkerState
from elastic.core.interfaces.store import Store
from elastic.core.interfaces.worker_watch import WorkerVerdict
from elastic.core.log import say
from elastic.core.plugin.config import ElasticConfig
from elastic.core.plugin.host import PluginHost
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.core.rendezvous.round.progress_lines import Say, round_line, say_stderr
from elastic.core.watchdog.builtin import register_builtins
from elastic.core.workers.control_file import ControlFile
from elastic.core.workers.logs import LogLayout, LogTailer, WorkerLogs, start_tailer
from elastic.core.workers.process import (
    DEFAULT_SIGNALS,
    Interrupted,
    SignalGuard,
    WorkerProcess,
    stop_workers,
)

FAILED_CHECK_INTERVAL = 1.0  # seconds between reads of the job-wide flags (JobWatch)
# Grace for workers stopped because the world they train in is gone (fenced, store lost),
# whatever --shutdown-timeout says; a fencing the handler reported stopped them already,
# with its own shorter grace (``fence.FenceGuard``), which this never extends.
FENCE_GRACE = 1.0


class LocalElasticAgent(ElasticAgent):
    """Supervises this node's workers as local processes (commands or callables).

    ``plugin_host``: the hook plugins (None: only the built-ins ``spec`` asks for)."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        plugin_host: PluginHost | None = None,
        config: ElasticConfig | None = None,
        signals_to_handle: tuple[str, ...] | list[str] = DEFAULT_SIGNALS,
        log_dir_suffix: str | None = None,
        exit_barrier_timeout: float = 300.0,
        quiet: bool = False,
    ) -> None:
        if spec.rdzv_handler is None:  # torch's standalone: one node, no server
            spec.rdzv_handler = LocalRendezvousHandler(str(uuid.uuid4()), spec.local_addr)
        self._spec = spec
        self._handler: RendezvousHandler = spec.rdzv_handler
        self._host = plugin_host if plugin_host is not None else PluginHost(autoload=False)
        self._config = config or ElasticConfig.from_spec(spec, self._handler)
        self._exit_barrier_timeout = exit_barrier_timeout
        self._signals = tuple(signals_to_handle)
        self._guard = SignalGuard(self._signals)
        self._suffix = log_dir_suffix
        self._group = WorkerGroup(spec)
        self._workers: list[WorkerProcess] = []
        self._logs: dict[int, WorkerLogs] = {}
        self._layout: LogLayout | None = None
        self._tailer: LogTailer | None = None
        self._store: Store | None = None
        self._node_id = f"{socket.gethostname()}_{id(self):x}"
        self._host_name: str | None = None
        self._attempts = 0
        self._failures: dict[int, fail.FailureRecord] = {}
        # --stall-timeout, the FileTimer server, --health-port (binds the port now)
        self._builtins = register_builtins(self._host, spec, clock=self._guard.clock)
        # --preemption-signal/--preemption-grace: a coordinated checkpoint on notice
        self._preempt_signum = getattr(signal, spec.preemption_signal, signal.SIGTERM)
        self._coordinator: Coordinator | None = None
        # Progress lines on stderr (rendezvous/round/progress_lines.py); --quiet: none.
        self._say: Say | None = None if quiet else say_stderr
        self._handler.set_progress(self._say)
        self._last_info: RendezvousInfo | None = None
        # Store calls on the decision paths: bounded by the handler's fencing (store_call).
        self._calls = BoundedCalls(self._handler)
        # Whether this node has joined the job (a failure before that is its own).
        self._joining = Joining()
        # Fenced: the workers stop at once, from the handler's thread (``fence``).
        self._fence = FenceGuard()
        self._handler.on_fenced(self._fence.fenced)

    # --- public -------------------------------------------------------------------------
    def get_worker_group(self) -> WorkerGroup:
        return self._group

    @property
    def run_log_dir(self) -> str | None:
        """``LOG_DIR/<run_id>_<suffix>``, once the first attempt has started."""
        return self._layout.run_dir if self._layout else None

    def run(self) -> RunResult:
        started = time.monotonic()
        self._notify("elastic_agent_start", spec=self._spec, config=self._config)
        # plugins' variables never override the launch's own
        self._spec.extra_env = {**self._host.worker_env(self._config), **self._spec.extra_env}
        code = exit_code(JobEnd.NODE_ERROR)
        result = RunResult(WorkerState.FAILED, exit_code=code, message="the agent raised")
        self._guard.install()
        try:
            try:
                result = self._loop()
            except Interrupted as sig:
                result = self._on_signal(sig.signum)
        finally:
            if self._workers:  # only on an unexpected exception: never leave workers
                self._stop(signal.SIGKILL, 0)
            self._guard.restore()
            with contextlib.suppress(Exception):
                self._handler.shutdown()
            if self._coordinator is not None:
                self._coordinator.control.close()
            self._group.state = result.state
            # Even when the agent raised: the built-ins close their servers on it.
            self._notify("elastic_run_end", result=result, duration=time.monotonic() - started)
            for name in self._builtins:
                self._host.unregister(name)
        return result

    # --- signals ------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> RunResult:
        name = signal.Signals(signum).name
        if signum == self._preempt_signum and self._coordinator is not None:
            checkpoint_before_leaving(
                self._coordinator,
                name,
                self._node_id,
                self._group.group_world_size or 1,
                self._spec.preemption_grace,
                self._workers,
            )
        # Tell the job first: the survivors regroup while our workers wind down, and a
        # departure never spends the restart budget or looks like a finished node.
        with contextlib.suppress(Exception):  # cut off: fenced, the others see us lost
            self._calls(self._handler.leave)
        self._stop(signum, self._spec.shutdown_timeout)
        message = f"the agent received {name}; its workers were stopped"
        say(f"elastic: {message}", logging.WARNING)
        code = exit_code(JobEnd.SIGNALLED, signum=signum)
        return RunResult(WorkerState.FAILED, exit_code=code, message=message)

    # --- the loop: rendezvous, start, watch, decide ----------------------------------------
    def _loop(self) -> RunResult:
        while True:
            info = self._rendezvous()
            if isinstance(info, RunResult):
                return info
            try:
                if self._calls(job_failed, self._store):
                    return self._final_failure("the job failed on another node")
                result = self._attempt(info)
            except (RendezvousFencedError, RendezvousStoreMovedError) as exc:
                # Cut off (a partition, the job declared us lost, a store call on the way
                # to a decision unanswered), or a call whose outcome a move of the store
                # left unknown: stop the workers, rejoin where the store answers now.
                self._stop(signal.SIGTERM, FENCE_GRACE)
                say(f"elastic: {exc}", logging.WARNING)
                reason = "fenced" if isinstance(exc, RendezvousFencedError) else "store moved"
                self._notify("elastic_restart", group=self._group, reason=reason)
                continue
            except RendezvousConnectionError as exc:
                self._stop(signal.SIGTERM, FENCE_GRACE)
                return self._one_line_failure(f"lost the rendezvous backend: {exc}")
            if result is not None:
                return result

    def _rendezvous(self) -> RendezvousInfo | RunResult:
        """This node's next round, or how the run ends when there is none."""
        t0 = time.monotonic()
        try:
            with self._guard.waiting():
                info = self._handler.next_rendezvous()
        except RendezvousGracefulExitError as exc:
            return RunResult(WorkerState.SUCCEEDED, message=f"not needed: {exc}")
        except RendezvousClosedError:
            return self._closed()
        except RendezvousConnectionError as exc:
            return self._one_line_failure(f"lost the rendezvous backend: {exc}")
        except RendezvousMismatchError as exc:
            # A user mistake (wrong software or command on this node): exit 2.
            return self._one_line_failure(f"refused by the job: {exc}", JobEnd.REFUSED)
        except RendezvousError as exc:
            return self._one_line_failure(f"rendezvous failed: {type(exc).__name__}: {exc}")
        self._store = info.store
        line = round_line(self._last_info, info) if self._say is not None else None
        if line is not None:  # our workers are stopped: the line cannot split one of theirs
            self._say(line)
        prev, self._last_info = self._last_info, info
        self._notify("elastic_rendezvous_complete", info=info, duration=time.monotonic() - t0)
        if prev is not None and prev.world_size != info.world_size:  # restarted or in place
            self._notify(
                "elastic_membership_changed",
                old_world_size=prev.world_size,
                new_world_size=info.world_size,
                round=info.round,
            )
        return info

    def _closed(self) -> RunResult:
        """The rendezvous is closed: the job ended, and its failed flag says how
        (``exit_code.after_close``), for a node that never ran workers (a standby, a late
        joiner: the handler names the job's store) as for any."""
        store = self._store if self._store is not None else self._handler.read_job_store()
        failed: bool | None = None
        if store is not None:
            with contextlib.suppress(RendezvousError):
                failed = bool(self._calls(job_failed, store))
        end = after_close(failed)
        if end is JobEnd.FAILED:
            self._store = store  # the job's summary: the same root cause as every node's
            return self._final_failure("the job failed on another node")
        if end is JobEnd.UNKNOWN:
            return self._one_line_failure(
                "the job ended while this node was out of it (fenced, regrouping or waiting "
                "for a round) and how it ended cannot be read from the rendezvous store: "
                "not reporting success",
                JobEnd.UNKNOWN,
            )
        # The others finished the job while this node was out of it (fenced, between
        # rounds, or late to start). A scheduler must see success, and the user why.
        say(
            "elastic: the job finished on the other nodes while this node was "
            "regrouping; nothing left to run"
        )
        return RunResult(WorkerState.SUCCEEDED, message="rendezvous is closed")

    def _attempt(self, info: RendezvousInfo) -> RunResult | None:
        """Start workers for this round, watch them, decide. None means: rendezvous again."""
        restarts = self._calls(restarts_used, info.store)
        self._joining.attempt_started(info.store, info.round, self._calls)
        self._guard.check()
        error = self._start(info, restarts)
        if error is not None:
            self._stop(signal.SIGKILL, 0)
            return self._one_line_failure(error)
        counted = False  # whether this node counted itself ready for the round (READY_KEY)
        while True:
            coordinator = self._coordinator
            assert coordinator is not None  # _start made it
            try:
                end = watch_attempt(
                    self._workers,
                    JobWatch(info.store, info.round, FAILED_CHECK_INTERVAL, self._handler),
                    interval=self._spec.monitor_interval,
                    sleep=self._sleep,
                    handler=self._handler,
                    check_plugins=self._check_plugins,
                    relay_checkpoint=functools.partial(self._calls, coordinator.relay),
                    regroup_wanted=RoundWatch(coordinator, info.world_size, counted=counted),
                    checkpoint_saved=coordinator.saved_here,
                )
            finally:  # fenced or not, workers that ran past start-up made this node a member
                self._joining.attempt_ended()
            if not can_regroup(end.outcome, coordinator.control, self._workers):
                return self._decide(info, end)
            regrouped = self._regroup_in_place(end.outcome)
            if not isinstance(regrouped, tuple):
                return regrouped
            info, counted = regrouped
            # Workers that took a new round in place have trained in this job.
            self._joining.ran = True

    def _regroup_in_place(self, outcome: Outcome) -> tuple[RendezvousInfo, bool] | RunResult | None:
        """The job re-forms and our workers can follow it (``core/agent/regroup.py``):
        join the next round and hand it to them; workers that do not take it in time are
        restarted in it. Returns the round to watch and whether this node counted itself
        ready for it (it did), or what ``_attempt`` returns."""
        assert self._coordinator is not None
        control = self._coordinator.control
        if outcome is not Outcome.MEMBERSHIP:  # the old group lost a member: stop now
            control.request_regroup()
        info = self._rendezvous()
        if isinstance(info, RunResult) or self._calls(job_failed, info.store):
            self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
            if isinstance(info, RunResult):
                return info
            return self._final_failure("the job failed on another node")
        # Until every node's workers can join, ours train on in the old group if they can.
        wait_ready(info.store, info.round, info.world_size, self._workers, self._sleep)
        if finished(self._workers, self._sleep):  # meanwhile, in the old round
            # The new round's new workers wait for a group that will not come: their
            # agents see the job finished and meet us at this round's exit barrier.
            announce_finished(info.store, info.round)
            return self._succeeded(info)
        control.request_regroup()  # every rank stops at one step boundary
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
        store, round_ = info.store, info.round

        def replaced() -> bool:
            try:
                return bool(self._calls(replaced_in, store, round_))
            except RendezvousError:
                return False  # cannot tell: the bound decides

        if wait_taken(
            control, generation, self._workers, self._sleep, replaced, patient=info.rank == 0
        ):
            if finished_untaken(control, generation, self._workers):
                announce_finished(info.store, info.round)  # as above, one step later
                return self._succeeded(info)
            self._notify("elastic_workers_started", group=self._group)
            return info, True
        with contextlib.suppress(RendezvousError):
            self._calls(announce_replaced, store, round_)
        say(
            "elastic: the workers did not take the new round in time (stuck in a "
            "collective?); restarting them",
            logging.WARNING,
        )
        self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
        self._notify("elastic_restart", group=self._group, reason="regroup_timeout")
        error = self._start(info, restarts)
        if error is not None:
            self._stop(signal.SIGKILL, 0)
            return self._one_line_failure(error)
        return info, True

    def _decide(self, info: RendezvousInfo, end: AttemptEnd) -> RunResult | None:
        outcome = end.outcome
        if outcome is Outcome.SUCCEEDED:
            self._group.state = WorkerState.SUCCEEDED
            return self._succeeded(info)
        if outcome is Outcome.FAILED:
            self._group.state = WorkerState.FAILED
            return self._on_failure(info, end)
        self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
        if outcome is Outcome.JOB_FAILED:
            return self._final_failure("the job failed on another node")
        self._notify("elastic_restart", group=self._group, reason=outcome.restart_reason)
        return None

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
            return {
                **self._host.worker_process_env(local_rank, error_file),
                **control.worker_env(local_rank),
            }

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
        self._fence.watch(self._workers, info.round)
        self._notify("elastic_workers_started", group=group)
        return None

    def _check_plugins(self, workers: list[WorkerProcess]) -> WorkerVerdict | None:
        return self._host.call_first("elastic_check_workers", workers=workers)

    # --- endings --------------------------------------------------------------------------
    def _succeeded(self, info: RendezvousInfo) -> RunResult | None:
        values = {w.local_rank: w.return_value() for w in self._workers}
        self._stop(signal.SIGTERM, 0)  # nothing left running in their groups
        timeout = self._exit_barrier_timeout
        with self._guard.waiting():
            barrier = exit_barrier(
                info.store,
                info.round,
                info.world_size,
                timeout,
                self._handler.lost_nodes,
                self._calls,
            )
        end = after_barrier(barrier)
        if end is None:  # another node's workers failed this round: rejoin
            self._notify("elastic_restart", group=self._group, reason="failure")
            return None
        if end is JobEnd.FAILED:
            return self._final_failure("the job failed on another node")
        if end is JobEnd.UNKNOWN:
            return self._one_line_failure(
                f"this node's workers finished, but not every member of the round reached "
                f"the exit barrier within {timeout:g}s, and none of those missing was found "
                "gone: whether the job succeeded is unknown here, so this is not a success",
                JobEnd.UNKNOWN,
            )
        with contextlib.suppress(Exception):
            self._calls(self._handler.set_closed)
        if not callable(self._spec.entrypoint):
            values = {}
        return RunResult(WorkerState.SUCCEEDED, return_values=values)

    def _on_failure(self, info: RendezvousInfo, end: AttemptEnd) -> RunResult | None:
        """Record the failed workers, then restart or give up; a departure costs nothing,
        a node that had not joined yet leaves alone (``joining``), and a store call left
        unanswered fences this node (``BoundedCalls``) instead of ending it."""
        if self._host_name is None:
            self._host_name = socket.getfqdn()
        records = failure_records(
            self._group,
            self._workers,
            end.failed,
            self._logs,
            node_id=self._node_id,
            host=self._host_name,
            first_attempt=self._attempts == 1,
        )
        if info.world_size > 1 and departure_caused(
            self._handler, self._store, info.round, records, self._sleep, self._calls
        ):
            # A node left or died and took our workers' collectives with it: re-form
            # the group without spending the restart budget or blaming our workers.
            self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
            self._notify("elastic_restart", group=self._group, reason="lost_node")
            return None
        if self._host.implemented("elastic_annotate_failures"):
            self._host.call("elastic_annotate_failures", records=records)
        self._failures = {r.rank: r for r in records}
        told = lambda record: self._notify("elastic_worker_failed", record=record)  # noqa: E731
        if self._joining.fails_alone(info.store, info.round, self._calls):
            stop = functools.partial(self._stop, signal.SIGTERM, self._spec.shutdown_timeout)
            return leave_alone(
                records,
                info.store,
                self._handler,
                self._host,
                call=self._calls,
                told=told,
                stop=stop,
            )
        # Workers that fail after every rank agreed training was done end the job: the
        # summary below says how they failed, this line why nothing runs again.
        after_done = self._coordinator is not None and (
            set(end.failed) <= self._coordinator.control.done()
        )
        final = publish_and_decide(
            records,
            info.store,
            self._handler,
            round_=info.round,
            node_id=self._node_id,
            # "No restart can mend it" is for a new job's first attempt, not a late joiner.
            first_attempt=self._attempts == 1 and bool(self._joining.in_first_round),
            max_restarts=self._spec.max_restarts,
            told=told,
            call=self._calls,
            after_done=after_done,
        )
        self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
        if final is not None:
            if after_done:
                say(f"elastic: {final}", logging.WARNING)
            return self._final_failure(final)
        self._notify("elastic_restart", group=self._group, reason="failure")
        return None

    def _final_failure(self, message: str) -> RunResult:
        """The run failed for good: one job-wide summary to the error reporting hook."""
        run_id = self._handler.get_run_id()
        root_cause = report_failure(self._store, run_id, self._host, message, self._calls)
        code = exit_code(JobEnd.FAILED, root_cause=root_cause)
        return RunResult(
            WorkerState.FAILED, failures=dict(self._failures), exit_code=code, message=message
        )

    def _one_line_failure(self, message: str, end: JobEnd = JobEnd.NODE_ERROR) -> RunResult:
        say(f"elastic: {message}", logging.ERROR)
        return RunResult(WorkerState.FAILED, exit_code=exit_code(end), message=message)

    # --- helpers --------------------------------------------------------------------------
    def _sleep(self, seconds: float, wait: Callable[[float], object] = time.sleep) -> None:
        with self._guard.waiting():  # a signal meanwhile is handled, not deferred
            wait(seconds)

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

    def _notify(self, hook: str, **kwargs: object) -> None:
        self._host.notify(hook, **kwargs)
