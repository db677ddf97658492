"""A failed attempt on this node: the failure records, the decision to restart or give
up, and the job's final report.

A failure costs one restart of the job-wide budget (``restarts``). It ends the job at
once when the budget is spent, or when the first attempt failed in a way no restart can
mend (a script that does not compile, a missing module); the job-wide root cause then
goes to ``elastic_run_failed`` (the errors plugin prints it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elastic.core.agent.restarts import claim_restart, give_up
from elastic.core.agent.store_call import store_call
from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.rendezvous import RendezvousHandler
from elastic.core.interfaces.spec import WorkerGroup
from elastic.core.interfaces.store import Store
from elastic.core.log import say
from elastic.core.plugin.host import PluginHost
from elastic.core.workers.logs import WorkerLogs, failure_record, script_syntax_error
from elastic.core.workers.process import WorkerProcess


def failure_records(
    group: WorkerGroup,
    workers: Sequence[WorkerProcess],
    failed: Mapping[int, tuple[int, float]],
    logs: Mapping[int, WorkerLogs],
    *,
    node_id: str,
    host: str,
    first_attempt: bool,
) -> list[fail.FailureRecord]:
    """One record per failed worker: those in ``failed`` (local rank -> (exit code, seen))
    and siblings that died on their own meanwhile; the ones the agent stops are not."""
    failed = dict(failed)
    by_rank = {w.local_rank: w for w in workers}
    for rank, w in by_rank.items():
        code = w.poll()
        if rank not in failed and code is not None and code != 0:
            failed[rank] = (code, time.time())
    records = [
        failure_record(
            group,
            group.workers[rank],
            by_rank[rank].pid,
            code,
            seen,
            logs[rank],
            node_id=node_id,
            round_=group.round,
            host=host,
        )
        for rank, (code, seen) in sorted(failed.items())
    ]
    if first_attempt:  # a script that does not compile names itself, whatever died first
        spec = group.spec
        syntax = script_syntax_error(spec.entrypoint, spec.args)
        for record in records if syntax else []:
            if "SyntaxError" not in record.message:
                record.message = syntax
    return records


def publish_and_decide(
    records: list[fail.FailureRecord],
    store: Store,
    handler: RendezvousHandler,
    *,
    round_: int,
    node_id: str,
    first_attempt: bool,
    max_restarts: int,
    told: Callable[[fail.FailureRecord], None],
    call: Callable[..., Any] = store_call,
    after_done: bool = False,
) -> str | None:
    """Publish the records job-wide (``told`` each one once it is), then claim a restart;
    why the job ends (after giving up for every node), or None to restart.

    The agent calls this before it stops the failed workers' siblings: peers learn of the
    failure (the restart claim, the failed flag) while the siblings' grace period runs.
    ``call`` makes every store call (the agent's ``BoundedCalls``: a partition meanwhile
    fences this node, which rejoins, instead of ending it). ``after_done``: every failed
    worker had agreed with every rank that training was done (``elastic.train``
    returned): the job ends with this failure rather than run again from its start.
    """
    for record in records:
        call(fail.publish, store, record)
        told(record)
    first = min(records, key=lambda r: r.timestamp)
    what = f"worker rank {first.rank} (local rank {first.local_rank}) " + (
        f"was killed by {first.signal}" if first.signal else f"exited with code {first.exit_code}"
    )
    final = None
    if after_done:
        final = f"{what} after every rank agreed training was done; not running it again"
    elif first_attempt and any(map(fail.is_deterministic_startup_failure, records)):
        final = f"{what} at start-up ({first.message}); not restarting"
    elif call(claim_restart, store, round_, node_id) > max_restarts:
        final = f"{what}; restart budget exhausted (max_restarts={max_restarts})"
    if final is not None:
        call(give_up, store, handler)
    return final


def report_failure(
    store: Store | None,
    run_id: str,
    host: PluginHost | None,
    message: str,
    call: Callable[..., Any] = store_call,
) -> int | None:
    """Hand the job-wide failure summary to ``elastic_run_failed``; the root cause's exit
    code (None: no summary could be read; ``exit_code`` maps both).

    Without a summary (no record published, store gone or cut off: ``call`` bounds the
    read) or without any implementation of the hook, print one line ourselves so a
    failed run never ends silently.
    """
    summary = None
    if store is not None:
        with contextlib.suppress(Exception):
            records = call(fail.collect, store)
            if records:
                summary = fail.summarize(run_id, records)
    reported = summary is not None and report_summary(summary, host)
    if not reported:
        say(f"elastic: run failed: {message}", logging.ERROR)
    return summary.exit_code if summary is not None else None


def report_summary(summary: fail.FailureSummary, host: PluginHost | None) -> bool:
    """Hand ``summary`` to ``elastic_run_failed``; whether a plugin reported it."""
    if host is None:
        return False
    try:
        impls = host.pm.hook.elastic_run_failed.get_hookimpls()
        host.call_strict("elastic_run_failed", summary=summary)
        return bool(impls)
    except Exception as exc:  # loud, but the exit code must still be right
        say(f"elastic: failure reporting raised {exc!r}", logging.ERROR)
        return False
