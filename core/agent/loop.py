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

This module holds the loop itself (rendezvous, start, watch, decide); the agent's other
methods live in its rooms over ``base.AgentBase``: ``crew`` (starting and stopping the
workers), ``endings`` (success, failure, a closed rendezvous), ``in_place`` (regrouping
the same workers) and ``signals``. It imports them and this package's helper modules.

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

from elastic.core.agent.checkpoint_on_notice import Coordinator
from elastic.core.agent.crew import Crew
from elastic.core.agent.endings import Endings
from elastic.core.agent.exit_code import JobEnd, exit_code
from elastic.core.agent.fence import FENCE_GRACE, FenceGuard
from elastic.core.agent.in_place import InPlaceRegroup
from elastic.core.agent.job_watch import JobWatch
from elastic.core.agent.joining import Joining
from elastic.core.agent.monitor import watch_attempt
from elastic.core.agent.outcome import AttemptEnd, Outcome
from elastic.core.agent.regroup import RoundWatch, can_hand_to_starting, can_regroup
from elastic.core.agent.restarts import job_failed, restarts_used
from elastic.core.agent.signals import SignalExit
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
    RendezvousStoreGoneError,
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
from elastic.core.workers.control_file import sweep_leftovers
from elastic.core.workers.logs import LogLayout, LogTailer, WorkerLogs
from elastic.core.workers.process import (
    DEFAULT_SIGNALS,
    Interrupted,
    SignalGuard,
    WorkerProcess,
)

FAILED_CHECK_INTERVAL = 1.0  # seconds between reads of the job-wide flags (JobWatch)


class LocalElasticAgent(Crew, Endings, InPlaceRegroup, SignalExit, ElasticAgent):
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
        # --warm-restarts: a restart's workers start in interpreters started ahead.
        self._spares = None
        if spec.warm_restarts:  # its module only then: an agent's start is mostly imports
            from elastic.core.workers.spare import SparePool

            self._spares = SparePool()

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
            if self._spares is not None:
                self._spares.close()
            self._guard.restore()
            with contextlib.suppress(Exception):
                self._handler.shutdown()
            if self._coordinator is not None:
                self._coordinator.control.close()
                # Once, as the agent ends: off every start and restart path.
                sweep_leftovers(self._coordinator.control.directory)
            if self._layout is not None:
                self._layout.tidy()
            self._group.state = result.state
            # Even when the agent raised: the built-ins close their servers on it.
            self._notify("elastic_run_end", result=result, duration=time.monotonic() - started)
            for name in self._builtins:
                self._host.unregister(name)
        return result

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

    def _rendezvous(
        self, kept: bool = False, waiting: bool = False, workers_round: int | None = None
    ) -> RendezvousInfo | RunResult:
        """This node's next round, or how the run ends when there is none. ``kept``: our
        workers, in round ``workers_round``, run on into it (they regroup in place);
        ``waiting``: their group lost a member, they wait for this round's."""
        t0 = time.monotonic()
        try:
            self._handler.set_workers_kept(kept, waiting, workers_round)
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
                    # its counts go to the store: bounded like every call on a decision path
                    regroup_wanted=RoundWatch(
                        coordinator, info.world_size, counted=counted, calls=self._calls
                    ),
                    checkpoint_saved=coordinator.saved_here,
                )
            except RendezvousStoreMovedError as exc:
                # The store's holder left while a count of ours was in flight: the job
                # re-forms without it like after any departure, and workers that can
                # regroup keep running (any other attempt stops them and rejoins: _loop).
                if not can_regroup(Outcome.LOST_NODE, coordinator.control, self._workers):
                    raise
                say(f"elastic: {exc}; the workers regroup in place", logging.WARNING)
                end = AttemptEnd(Outcome.LOST_NODE)
            finally:  # fenced or not, workers that ran past start-up made this node a member
                self._joining.attempt_ended()
            kept = can_regroup(end.outcome, coordinator.control, self._workers)
            if kept:
                regrouped = self._regroup_across_moves(end.outcome)
            elif self._calls(
                can_hand_to_starting, end.outcome, coordinator.control, self._workers, info.store
            ):
                regrouped = self._hand_to_starting()  # still starting: not restarted
            else:
                return self._decide(info, end)
            if not isinstance(regrouped, tuple):
                return regrouped
            info, counted = regrouped
            # Workers that took a new round in place have trained in this job.
            self._joining.ran = self._joining.ran or kept

    def _regroup_across_moves(
        self, outcome: Outcome
    ) -> tuple[RendezvousInfo, bool] | RunResult | None:
        """``_regroup_in_place``; when the store's holder leaves while one of the regroup's
        counts is in flight (waiting for the joiners to get ready), the job re-forms
        without the holder as after any departure: the same workers go on to the next
        round where the store is now (``_loop`` would stop them and lose their state)."""
        peers = self._workers_peers()  # before the next rendezvous moves the handler on
        while True:
            try:
                return self._regroup_in_place(outcome, peers)
            except RendezvousStoreMovedError as exc:
                coordinator = self._coordinator
                assert coordinator is not None
                if not can_regroup(Outcome.LOST_NODE, coordinator.control, self._workers):
                    raise
                say(f"elastic: {exc}; the workers regroup in place", logging.WARNING)
                outcome = Outcome.LOST_NODE
            except RendezvousStoreGoneError:
                raise
            except RendezvousConnectionError as exc:
                # A count of the regroup's own waits (the nodes' readiness) unanswered:
                # a partition, as on every decision path (``BoundedCalls``), so this node
                # stops its workers and rejoins; it never exits for it.
                raise RendezvousFencedError(
                    f"cannot reach the rendezvous store while the job re-forms ({exc}): "
                    "stopping this node's workers; it rejoins when the store answers"
                ) from exc

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

    def _check_plugins(self, workers: list[WorkerProcess]) -> WorkerVerdict | None:
        return self._host.call_first("elastic_check_workers", workers=workers)
