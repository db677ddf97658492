"""Every hook an ``elastic.plugins`` plugin may implement, in one place.

A plugin is a module (or object) named by an entry point in the ``elastic.plugins``
group, holding functions decorated with ``elastic.core.hookspecs.hookimpl`` whose names
match the specifications below. Hooks are broadcast: every registered implementation is
called. Lifecycle and metrics hooks are called one implementation at a time, so one that
raises is reported once and dropped without stopping the job; error reporting hooks fail
loudly. A hookimpl whose name matches no specification is an error at load time.

Hooks run in the agent process (never in workers) and must not block for long: the
agent's monitor loop waits for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from elastic.core.failures import FailureRecord, FailureSummary
    from elastic.core.rendezvous import RendezvousInfo
    from elastic.core.spec import RunResult, WorkerGroup, WorkerSpec

PROJECT = "elastic"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def elastic_agent_start(spec: WorkerSpec, settings: dict[str, object]) -> None:
    """Called once when an agent starts, before its first rendezvous.

    ``settings`` holds the launcher's options by name (e.g. ``error_summary``,
    ``metrics_sink``) so a plugin can read the flags that concern it.
    """


@hookspec
def elastic_rendezvous_complete(info: RendezvousInfo, duration: float) -> None:
    """Called after every completed rendezvous round with its outcome for this node and
    how long the round took in seconds."""


@hookspec
def elastic_workers_started(group: WorkerGroup) -> None:
    """Called when this node's workers of an attempt have all been started."""


@hookspec
def elastic_worker_failed(record: FailureRecord) -> None:
    """Called once for each worker of this node that failed (not for workers the agent
    stopped itself because a sibling failed or membership changed)."""


@hookspec
def elastic_restart(group: WorkerGroup, reason: str) -> None:
    """Called when the agent stops its workers to start them again. ``reason`` is
    ``"failure"``, ``"membership"`` (a node arrived) or ``"lost_node"``."""


@hookspec
def elastic_membership_changed(old_world_size: int, new_world_size: int, round: int) -> None:
    """Called when a new round has a different number of nodes than the previous one."""


@hookspec
def elastic_run_failed(summary: FailureSummary) -> None:
    """Called once when the run failed for good, with the job-wide root cause first."""


@hookspec
def elastic_run_end(result: RunResult, duration: float) -> None:
    """Called once when the agent's run is over, succeeded or not."""
