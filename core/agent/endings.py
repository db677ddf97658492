"""The agent's endings room: how a run ends on this node (``AgentBase``, ``base.py``).

Owns ``_succeeded`` (the workers finished: the exit barrier, then success, a rejoin or the
job's failure), ``_on_failure`` (records, a departure that costs nothing, a node that had
not joined leaving alone, the restart budget), ``_closed`` (the rendezvous closed: the
job's failed flag says how), ``_final_failure`` (the job-wide summary) and
``_one_line_failure`` (a node's own error, one line). The rules themselves live in this
package's helper modules it imports: ``exit_barrier``, ``exit_code``, ``failure``,
``restarts``, ``departure``, ``joining``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import socket

from elastic.core.agent.base import AgentBase
from elastic.core.agent.departure import departure_caused
from elastic.core.agent.exit_barrier import exit_barrier
from elastic.core.agent.exit_code import JobEnd, after_barrier, after_close, exit_code
from elastic.core.agent.failure import failure_records, publish_and_decide, report_failure
from elastic.core.agent.joining import leave_alone
from elastic.core.agent.outcome import AttemptEnd
from elastic.core.agent.restarts import job_failed
from elastic.core.interfaces.rendezvous import RendezvousError, RendezvousInfo
from elastic.core.interfaces.spec import RunResult, WorkerState
from elastic.core.log import say


class Endings(AgentBase):
    """Success, failure and a closed rendezvous, as this node ends them."""

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
