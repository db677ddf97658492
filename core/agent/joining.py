"""Has this node joined the job? Until it has, a failure of its workers is its own.

A node added to a running job may bring a broken environment: a module missing on that
host, a file that is not there, a bad driver. Its workers then fail at start-up on every
attempt, and no restart of the job can mend that. Such a failure must neither spend the
job's restart budget nor end the job: the node leaves alone, with its own error and a
one-line reason, and the others regroup without it as after any departure.

The rule, in one place (``Joining.fails_alone``). A failure of this node's workers is the
node's own, not the job's, when all three hold:

1. the node joined a job that had already started workers without it: its first attempt
   is in a later round than the job's first (``FIRST_ROUND_KEY``, written once by every
   node at its first attempt, holds the job's first round);
2. none of its workers' attempts on this node has yet lived past start-up, i.e. run for
   ``STARTUP_WINDOW`` s (an attempt that did is a member that ran, whatever ended it);
3. no other node claimed this round's restart: when a member that ran failed too, this
   failure is part of the job's, whose restart is already claimed, and the node restarts
   with the others.

Everything else is a failure of a member that ran: the restart budget, giving up, and the
rule that a brand-new job whose first attempt fails in a way no restart can mend (a
syntax error, a missing module) ends at once (``failure.publish_and_decide``) apply. The
nodes of the job's first round have joined from the start, so a script that fails
everywhere at start still ends a new job with its root cause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from elastic.core.agent.exit_code import JobEnd, exit_code
from elastic.core.agent.failure import report_summary
from elastic.core.agent.restarts import restart_claimed
from elastic.core.interfaces import failures as fail
from elastic.core.interfaces.rendezvous import RendezvousError, RendezvousHandler
from elastic.core.interfaces.spec import RunResult, WorkerState
from elastic.core.interfaces.store import Store
from elastic.core.log import say
from elastic.core.plugin.host import PluginHost

# The job's first round in which workers started: compare_set once per node, first wins.
FIRST_ROUND_KEY = "agent/first_round"
# How long this node's workers must have run before a failure of theirs is the job's: as
# long as a slow start-up takes (importing a large framework on a busy host, loading a
# driver), well short of a training run. A failure after it costs a restart as any.
STARTUP_WINDOW = 60.0
MAX_CAUSE = 300  # characters of the worker's error message in the one-line reason


class Joining:
    """This node's side of the rule above; the agent tells it when attempts start and end."""

    def __init__(self, window: float = STARTUP_WINDOW) -> None:
        self.window = window
        self.in_first_round: bool | None = None  # None: no attempt started yet
        self.ran = False  # an attempt of this node's workers lived past start-up
        self._started: float | None = None

    def attempt_started(self, store: Store, round_: int, call: Callable[..., Any]) -> None:
        """Before this node's workers start in ``round_`` (``call`` makes the store call:
        one compare_set, at this node's first attempt only)."""
        if self.in_first_round is None:
            first = call(store.compare_set, FIRST_ROUND_KEY, "", str(round_))
            try:  # from the store: untrusted; anything but an earlier round keeps the old rules
                self.in_first_round = int(bytes(first)[:20]) >= round_
            except ValueError:
                self.in_first_round = True
        self._started = time.monotonic()

    def attempt_ended(self) -> None:
        """The attempt's end was seen (whatever it was)."""
        if self._started is not None and time.monotonic() - self._started >= self.window:
            self.ran = True
        self._started = None

    @property
    def joined(self) -> bool:
        """Rules 1 and 2: this node is a member that ran (or was there from the start)."""
        return self.ran or self.in_first_round is not False

    def fails_alone(self, store: Store, round_: int, call: Callable[..., Any]) -> bool:
        """Whether this attempt's failure is this node's own (the rule above)."""
        if self.joined:
            return False
        return not call(restart_claimed, store, round_)


def leave_alone(
    records: list[fail.FailureRecord],
    store: Store,
    handler: RendezvousHandler,
    host: PluginHost | None,
    *,
    call: Callable[..., Any],
    told: Callable[[fail.FailureRecord], None],
    stop: Callable[[], None],
) -> RunResult:
    """A node whose workers failed before it joined leaves the job: how its run ends.

    The records are published marked ``BEFORE_JOINING`` (``interfaces/failures.py``:
    ``elastic status`` and every summary name this node only while nothing else failed),
    then the node leaves: the others see a departure and regroup without spending a
    restart. A store that cannot be reached meanwhile does not keep the node: it leaves
    all the same. Then ``stop`` (the workers), this node's own summary to
    ``elastic_run_failed`` and one line saying why it left."""
    for record in records:
        record.extra[fail.BEFORE_JOINING] = True
    reachable = True
    for record in records:
        if reachable:
            try:
                call(fail.publish, store, record)
            except RendezvousError:
                reachable = False
        told(record)
    try:
        call(handler.leave)
    except RendezvousError:
        pass  # cut off: the others find this node lost by its heartbeat instead
    stop()
    summary = fail.summarize(handler.get_run_id(), records)
    report_summary(summary, host)
    first = summary.root_cause
    what = f"worker rank {first.rank} (local rank {first.local_rank}) " + (
        f"was killed by {first.signal}" if first.signal else f"exited with code {first.exit_code}"
    )
    cause = first.message.strip().splitlines()[0][:MAX_CAUSE] if first.message.strip() else ""
    reason = (
        f"this node's workers failed at start-up before it had joined the running job: "
        f"{what}{f' ({cause})' if cause else ''}; this node leaves, the job goes on "
        "without it and no restart is spent"
    )
    say(f"elastic: {reason}", logging.ERROR)
    failures = {r.rank: r for r in records}
    code = exit_code(JobEnd.LEFT_ALONE, root_cause=summary.exit_code)
    return RunResult(WorkerState.FAILED, failures=failures, exit_code=code, message=reason)
