"""The node agent: rendezvous, start this node's workers, watch them, restart or finish.

One loop per node. Each round the agent rendezvouses, assigns ranks, starts its workers
and checks them every ``monitor_interval`` seconds. A failed worker stops the whole local
group and costs one restart of the job-wide budget (kept in the rendezvous store, so every
node agrees on ``TORCHELASTIC_RESTART_COUNT``); a node arriving or leaving stops the group
without costing anything. Signals sent to the agent are forwarded to every worker's
process group, and the agent exits with ``128 + signum`` once they are gone.

The agent never imports torch: it only needs the rendezvous handler and its store.
"""

from __future__ import annotations

import abc
import contextlib
import signal
import socket
import sys
import time
import uuid
from typing import Any

from elastic.core.agent.checkpoint_on_notice import Coordinator, checkpoint_before_leaving
from elastic.core.agent.departure import departure_caused
from elastic.core.agent.job_state import (
    JobWatch,
    claim_restart,
    exit_barrier,
    report_failure,
    store_call,
)
from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.job_keys import FAILED_KEY, RESTARTS_KEY
from elastic.core.interfaces.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousFencedError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousMismatchError,
)
from elastic.core.interfaces.spec import RunResult, WorkerGroup, WorkerSpec, WorkerState
from elastic.core.interfaces.store import Store
from elastic.core.plugin.config import ElasticConfig
from elastic.core.plugin.host import PluginHost
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.core.rendezvous.round.progress_lines import Say, round_line, say_stderr
from elastic.core.watchdog.stall import StallWatchdog
from elastic.core.workers.control_file import ControlFile
from elastic.core.workers.env import assign_ranks, substitute_args, worker_vars
from elastic.core.workers.logs import (
    LogLayout,
    LogTailer,
    WorkerLogs,
    failure_record,
    script_syntax_error,
    start_tailer,
)
from elastic.core.workers.process import (
    DEFAULT_SIGNALS,
    Interrupted,
    SignalGuard,
    WorkerProcess,
    start_worker,
    stop_workers,
)

MEMBERSHIP_CHECK_INTERVAL = 0.5  # seconds between num_nodes_waiting()/lost_nodes() calls
FAILED_CHECK_INTERVAL = 1.0  # seconds between checks of the job-wide failed flag
# Grace for workers stopped because the world they train in is gone (fenced, store lost):
# they must be down within heartbeat_timeout + 1 s, whatever --shutdown-timeout says.
FENCE_GRACE = 1.0


class ElasticAgent(abc.ABC):
    """An agent runs one node's share of a job and reports how it ended."""

    @abc.abstractmethod
    def run(self) -> RunResult:
        """Run the workers to completion (restarting them as needed)."""

    @abc.abstractmethod
    def get_worker_group(self) -> WorkerGroup:
        """This node's current worker group (its state, ranks and round)."""


class LocalElasticAgent(ElasticAgent):
    """Supervises this node's workers as local processes (commands or callables)."""

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
        self._host = plugin_host  # None: no hook plugins
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
        # --stall-timeout, FileTimer server, --health-port (binds the port now)
        self._stall = StallWatchdog(spec)
        # --preemption-signal/--preemption-grace: a coordinated checkpoint on notice
        self._preempt_signum = getattr(signal, spec.preemption_signal, signal.SIGTERM)
        self._coordinator: Coordinator | None = None
        # Progress lines on stderr (rendezvous/round/progress_lines.py); --quiet: none.
        self._say: Say | None = None if quiet else say_stderr
        self._handler.set_progress(self._say)
        self._last_info: RendezvousInfo | None = None

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
        if self._host is not None:  # plugins' variables never override the launch's own
            self._spec.extra_env = {**self._host.worker_env(self._config), **self._spec.extra_env}
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
            self._stall.close()
            if self._coordinator is not None:
                self._coordinator.control.close()
        self._group.state = result.state
        self._notify("elastic_run_end", result=result, duration=time.monotonic() - started)
        return result

    # --- signals ------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> RunResult:
        name = signal.Signals(signum).name
        if signum == self._preempt_signum:
            self._checkpoint_before_leaving(name)
        # Tell the job first: the survivors regroup while our workers wind down, and a
        # departure never spends the restart budget or looks like a finished node.
        with contextlib.suppress(Exception):
            self._handler.leave()
        self._stop(signum, self._spec.shutdown_timeout)
        message = f"the agent received {name}; its workers were stopped"
        print(f"elastic: {message}", file=sys.stderr, flush=True)
        return RunResult(WorkerState.FAILED, exit_code=128 + signum, message=message)

    def _checkpoint_before_leaving(self, name: str) -> None:
        """A preemption notice: the whole job checkpoints at its next step boundary.
        Only for scripts that use ``elastic.checkpoint_requested()``: the others would
        never save, so nobody waits for them."""
        coordinator, grace = self._coordinator, self._spec.preemption_grace
        if coordinator is None or not self._workers or grace <= 0:
            return
        if coordinator.control.listening():
            checkpoint_before_leaving(
                coordinator,
                name,
                self._node_id,
                self._group.group_world_size or 1,
                grace,
                lambda: all(w.poll() is None for w in self._workers),
            )

    # --- the loop -----------------------------------------------------------------------
    def _loop(self) -> RunResult:
        prev_world_size: int | None = None
        while True:
            try:
                info = self._rendezvous()
            except RendezvousGracefulExitError as exc:
                return RunResult(WorkerState.SUCCEEDED, message=f"not needed: {exc}")
            except RendezvousClosedError:
                if self._attempts == 0:
                    return RunResult(WorkerState.SUCCEEDED, message="rendezvous is closed")
                with contextlib.suppress(RendezvousConnectionError):
                    if self._job_failed():
                        return self._final_failure("the job failed on another node")
                # Closed without failing: the others finished the job while this node was
                # out of it (fenced, or between rounds). A scheduler must see success.
                print(
                    "elastic: the job finished on the other nodes while this node was "
                    "regrouping; nothing left to run",
                    file=sys.stderr,
                    flush=True,
                )
                return RunResult(WorkerState.SUCCEEDED, message="rendezvous is closed")
            except RendezvousConnectionError as exc:
                return self._one_line_failure(f"lost the rendezvous backend: {exc}")
            except RendezvousMismatchError as exc:
                # A user mistake (wrong software or command on this node): exit 2.
                return self._one_line_failure(f"refused by the job: {exc}", exit_code=2)
            except RendezvousError as exc:
                return self._one_line_failure(f"rendezvous failed: {type(exc).__name__}: {exc}")
            try:
                if prev_world_size is not None and prev_world_size != info.world_size:
                    self._notify(
                        "elastic_membership_changed",
                        old_world_size=prev_world_size,
                        new_world_size=info.world_size,
                        round=info.round,
                    )
                prev_world_size = info.world_size
                if self._job_failed():
                    return self._final_failure("the job failed on another node")
                result = self._run_attempt(info)
            except RendezvousFencedError as exc:
                self._stop(signal.SIGTERM, FENCE_GRACE)
                print(f"elastic: {exc}", file=sys.stderr, flush=True)
                self._notify("elastic_restart", group=self._group, reason="fenced")
                continue
            except RendezvousConnectionError as exc:
                self._stop(signal.SIGTERM, FENCE_GRACE)
                return self._one_line_failure(f"lost the rendezvous backend: {exc}")
            if result is not None:
                return result

    def _rendezvous(self) -> RendezvousInfo:
        t0 = time.monotonic()
        with self._guard.waiting():
            info = self._handler.next_rendezvous()
        self._store = info.store
        line = round_line(self._last_info, info) if self._say is not None else None
        if line is not None:  # our workers are stopped: the line cannot split one of theirs
            self._say(line)
        self._last_info = info
        self._notify("elastic_rendezvous_complete", info=info, duration=time.monotonic() - t0)
        return info

    def _run_attempt(self, info: RendezvousInfo) -> RunResult | None:
        """Start workers for this round and watch them. None means: rendezvous again."""
        restarts = int(store_call(info.store.add, RESTARTS_KEY, 0))
        self._guard.check()
        error = self._start(info, restarts)
        if error is not None:
            self._stop(signal.SIGKILL, 0)
            return self._one_line_failure(error)
        outcome, failed = self._monitor(info)
        if outcome == "succeeded":
            return self._succeeded(info)
        if outcome == "job_failed":
            self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
            return self._final_failure("the job failed on another node")
        if outcome in ("membership", "lost_node", "peer_failed"):
            self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
            reason = "failure" if outcome == "peer_failed" else outcome
            self._notify("elastic_restart", group=self._group, reason=reason)
            return None
        # "failed", or "stalled" (core/watchdog/stall.py: hung workers were dumped, then killed)
        return self._on_failure(info, failed)

    def _start(self, info: RendezvousInfo, restarts: int) -> str | None:
        spec = self._spec
        group = self._group
        group.group_rank, group.group_world_size = info.rank, info.world_size
        group.master_addr, group.master_port = info.master_addr, info.master_port
        group.restart_count, group.round = restarts, info.round
        group.workers = assign_ranks(spec, info.rank, info.world_size)
        if info.members and 0 <= info.rank < len(info.members):
            self._node_id = info.members[info.rank]
        run_id = self._handler.get_run_id()
        try:
            if self._layout is None:
                self._layout = LogLayout(
                    run_id,
                    spec.log_dir,
                    spec.redirects,
                    spec.tee,
                    spec.local_ranks_filter,
                    suffix=self._suffix,
                )
            self._logs = self._layout.attempt(restarts, spec.local_world_size)
        except OSError as exc:
            return f"cannot create the log directory: {exc}"
        extra = {"TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(self._signals), **spec.extra_env}
        self._attempts += 1
        if self._coordinator is not None:  # each attempt starts with no request pending
            self._coordinator.control.close()
        coordinator = Coordinator(info.store, info.round, ControlFile(spec.local_world_size))
        self._coordinator = coordinator
        try:
            for worker in group.workers:
                logs = self._logs[worker.local_rank]
                wvars = worker_vars(
                    group,
                    worker,
                    run_id=run_id,
                    use_agent_store=self._handler.use_agent_store,
                    error_file=logs.error_file,
                )
                wvars.update(self._stall.worker_env(worker.local_rank, logs.error_file))
                wvars.update(coordinator.control.worker_env())
                args = substitute_args(spec.args, worker.local_rank)
                proc = start_worker(spec, worker.local_rank, args, wvars, extra, logs)
                worker.pid = proc.pid
                self._workers.append(proc)
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
        self._notify("elastic_workers_started", group=group)
        return None

    def _monitor(self, info: RendezvousInfo) -> tuple[str, dict[int, tuple[int, float]]]:
        """Watch the workers until something happens; sleeps between checks. Reads only
        cached job and membership state, so a partition cannot hold this loop up."""
        watch = JobWatch(info.store, info.round, FAILED_CHECK_INTERVAL)
        try:
            return self._watch_workers(watch)
        finally:
            watch.stop()

    def _watch_workers(self, watch: JobWatch) -> tuple[str, dict[int, tuple[int, float]]]:
        next_membership = time.monotonic() + MEMBERSHIP_CHECK_INTERVAL
        while True:
            with self._guard.waiting():
                time.sleep(self._spec.monitor_interval)
            now = time.time()
            codes = {w.local_rank: w.poll() for w in self._workers}
            failed = {r: (c, now) for r, c in codes.items() if c is not None and c != 0}
            if failed:
                self._group.state = WorkerState.FAILED
                return "failed", failed
            if all(c == 0 for c in codes.values()):
                self._group.state = WorkerState.SUCCEEDED
                return "succeeded", {}
            stalled = self._stall.check(self._workers)  # core/watchdog/stall.py: a hang found here
            if stalled is not None:
                return stalled
            if watch.error is not None:
                raise RendezvousConnectionError(str(watch.error))
            if watch.failed:
                return "job_failed", {}
            if watch.peer_failed:
                return "peer_failed", {}  # a peer's workers failed this round
            if watch.checkpoint_requested and self._coordinator is not None:
                store_call(self._coordinator.relay)  # a node got a preemption notice
            mono = time.monotonic()
            if mono >= next_membership:
                next_membership = mono + MEMBERSHIP_CHECK_INTERVAL
                if store_call(self._handler.lost_nodes):  # raises when we are fenced
                    return "lost_node", {}
                if store_call(self._handler.num_nodes_waiting) > 0:
                    return "membership", {}

    # --- endings --------------------------------------------------------------------------
    def _succeeded(self, info: RendezvousInfo) -> RunResult | None:
        values = {w.local_rank: w.return_value() for w in self._workers}
        self._stop(signal.SIGTERM, 0)  # nothing left running in their groups
        timeout = self._exit_barrier_timeout
        with self._guard.waiting():
            barrier = exit_barrier(
                info.store, info.round, info.world_size, timeout, self._handler.lost_nodes
            )
        if barrier == "failed":
            return self._final_failure("the job failed on another node")
        if barrier == "restart":
            self._notify("elastic_restart", group=self._group, reason="failure")
            return None
        with contextlib.suppress(Exception):
            self._handler.set_closed()
        if not callable(self._spec.entrypoint):
            values = {}
        return RunResult(WorkerState.SUCCEEDED, return_values=values)

    def _on_failure(
        self, info: RendezvousInfo, failed: dict[int, tuple[int, float]]
    ) -> RunResult | None:
        """Record the failed workers, stop the rest, then restart or give up."""
        workers = {w.local_rank: w for w in self._workers}
        for rank, w in workers.items():  # siblings that died on their own meanwhile
            code = w.poll()
            if rank not in failed and code is not None and code != 0:
                failed[rank] = (code, time.time())
        if self._host_name is None:
            self._host_name = socket.getfqdn()
        records = [
            failure_record(
                self._group,
                self._group.workers[rank],
                workers[rank].pid,
                code,
                seen,
                self._logs[rank],
                node_id=self._node_id,
                round_=info.round,
                host=self._host_name,
            )
            for rank, (code, seen) in sorted(failed.items())
        ]
        if self._attempts == 1:
            syntax = script_syntax_error(self._spec.entrypoint, self._spec.args)
            for record in records if syntax else []:
                if "SyntaxError" not in record.message:
                    record.message = syntax
        if info.world_size > 1 and self._departure_caused(records):
            # A node left or died and took our workers' collectives with it: re-form
            # the group without spending the restart budget or blaming our workers.
            self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
            self._notify("elastic_restart", group=self._group, reason="lost_node")
            return None
        self._stall.annotate(records)  # stacks, the stall or the expired FileTimer
        # Publish and decide before stopping the siblings: peers learn of the failure (the
        # restart claim, the failed flag) while our grace period runs, not after it.
        self._failures = {r.rank: r for r in records}
        for record in records:
            store_call(fail.publish, info.store, record)
            self._notify("elastic_worker_failed", record=record)
        first = min(records, key=lambda r: r.timestamp)
        what = f"worker rank {first.rank} (local rank {first.local_rank}) " + (
            f"was killed by {first.signal}"
            if first.signal
            else f"exited with code {first.exit_code}"
        )
        final = None
        if self._attempts == 1 and any(map(fail.is_deterministic_startup_failure, records)):
            final = f"{what} at start-up ({first.message}); not restarting"
        elif claim_restart(info.store, info.round, self._node_id) > self._spec.max_restarts:
            final = f"{what}; restart budget exhausted (max_restarts={self._spec.max_restarts})"
        if final is not None:
            self._give_up()
        self._stop(signal.SIGTERM, self._spec.shutdown_timeout)
        if final is not None:
            return self._final_failure(final)
        self._notify("elastic_restart", group=self._group, reason="failure")
        return None

    def _departure_caused(self, records: list[fail.FailureRecord]) -> bool:
        def sleep(seconds: float) -> None:
            with self._guard.waiting():  # a signal meanwhile is handled, not deferred
                time.sleep(seconds)

        return departure_caused(self._handler, self._store, self._group.round, records, sleep)

    def _give_up(self) -> None:
        assert self._store is not None
        store_call(self._store.set, FAILED_KEY, "1")
        with contextlib.suppress(RendezvousError):
            self._handler.set_closed()

    def _job_failed(self) -> bool:
        return self._store is not None and bool(store_call(self._store.check, [FAILED_KEY]))

    def _final_failure(self, message: str) -> RunResult:
        """The run failed for good: one job-wide summary to the error reporting hook."""
        code = report_failure(self._store, self._handler.get_run_id(), self._host, message)
        return RunResult(
            WorkerState.FAILED, failures=dict(self._failures), exit_code=code, message=message
        )

    def _one_line_failure(self, message: str, exit_code: int = 1) -> RunResult:
        print(f"elastic: {message}", file=sys.stderr, flush=True)
        return RunResult(WorkerState.FAILED, exit_code=exit_code, message=message)

    # --- helpers --------------------------------------------------------------------------
    def _stop(self, sig: int, timeout: float) -> None:
        """Stop every worker (their whole process groups), reap them, stop the tee."""
        if self._workers:
            stop_workers(self._workers, sig, timeout)
        self._workers = []
        if self._tailer is not None:
            self._tailer.stop()
            self._tailer = None
        if self._group.state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY):
            self._group.state = WorkerState.STOPPED

    def _notify(self, hook: str, **kwargs: Any) -> None:
        self._stall.on_event(hook, kwargs)
        if self._host is not None:
            self._host.notify(hook, **kwargs)
