"""Every hook an ``elastic.plugins`` plugin may implement, in one place.

A plugin is named by an entry point in the ``elastic.plugins`` group. The entry point is
either a module of functions decorated with ``elastic.core.plugin.hookspecs.hookimpl``, or a
class whose methods are: the class is instantiated once per agent (with no arguments),
so per-run state lives on that object, never in module globals. Names must match the
specifications below; a hookimpl that matches none is an error at load time.

Hooks are called through pluggy with its rules: every implementation is called, the
last registered first, ``@hookimpl(tryfirst=True)`` / ``trylast=True`` move one to the
front or back, and wrappers (``wrapper=True``, or the old ``hookwrapper=True``) run
around all of them and see their results. A hook that returns something returns the
list of non-None results, in call order.

Every hook except those in ``STRICT_HOOKS`` is isolated: an implementation that raises
is reported once on stderr, its plugin is unregistered for the rest of the run, and the
call goes on without it (``elastic.core.plugin.isolation``). ``elastic_run_failed`` is
strict: a failure to report the error is itself reported loudly.

Hooks run in the agent process (``elastic_addoption`` also in the CLI), never in
workers, and must not block for long: the agent's monitor loop waits for them.
``ELASTIC_TRACE_PLUGINS=1`` prints every call on stderr.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord, FailureSummary
    from elastic.core.interfaces.rendezvous import RendezvousInfo
    from elastic.core.interfaces.spec import RunResult, WorkerGroup, WorkerSpec
    from elastic.core.interfaces.worker_watch import WorkerHandle, WorkerVerdict
    from elastic.core.plugin.config import ElasticConfig
    from elastic.core.plugin.options import PluginOptionParser

PROJECT = "elastic"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# Hooks whose exceptions propagate to the caller instead of dropping the plugin.
STRICT_HOOKS = frozenset({"elastic_run_failed"})


@hookspec
def elastic_addoption(parser: PluginOptionParser) -> None:
    """Add this plugin's options to ``elastic run`` (pytest's ``pytest_addoption``).

    Called when ``elastic run`` builds its command line (so ``elastic run --help`` lists
    the options under the plugin's name) and when the Python API fills in defaults.
    ``parser.addoption("--my-flag", help=..., default=..., type=conv, choices=...,
    is_flag=..., envvar=...)``; ``type`` converts the text and raises ``ValueError``
    with one line for bad input (the CLI then exits 2 with that line). A name or dest
    already taken raises ``OptionConflictError`` (and drops the plugin). The value
    reaches the other hooks as ``config.plugin_options[dest]`` (``config.option(dest)``).
    """


@hookspec
def elastic_agent_start(spec: WorkerSpec, config: ElasticConfig) -> None:
    """Called once when an agent starts, before its first rendezvous.

    ``config`` is the launch's ``ElasticConfig`` (frozen): the core options and, in
    ``plugin_options``, the values of the options plugins added. ``spec`` is the
    agent's ``WorkerSpec``.
    """


@hookspec
def elastic_worker_env(config: ElasticConfig) -> dict[str, str] | None:
    """Variables to add to every worker's environment (e.g. where to find a service).

    Called once per agent, right after ``elastic_agent_start`` and before any worker
    starts. Answers are merged; for a key set by several plugins the first one called
    wins. Variables the launch sets itself (``WorkerSpec.extra_env``, torchrun's
    ``RANK``, ``WORLD_SIZE``, ...) are never overridden.
    """


@hookspec
def elastic_rendezvous_complete(info: RendezvousInfo, duration: float) -> None:
    """Called after every completed rendezvous round with its outcome for this node and
    how long the round took in seconds."""


@hookspec
def elastic_workers_started(group: WorkerGroup) -> None:
    """Called when this node's workers of an attempt have all been started."""


@hookspec
def elastic_worker_process_env(local_rank: int, error_file: str) -> dict[str, str] | None:
    """Variables for one worker process, added when each attempt starts its workers.

    Called for every local worker at every (re)start, after the rendezvous and before the
    process starts; ``error_file`` is where torch's error file for that worker goes (a
    plugin may put its own files beside it). Answers are merged like
    ``elastic_worker_env``'s and never override torchrun's variables.
    """


@hookspec(firstresult=True)
def elastic_check_workers(workers: Sequence[WorkerHandle]) -> WorkerVerdict | None:
    """Called every ``--monitor-interval`` seconds while this node's workers run (the
    live ones are ``workers``), after the agent found none failed or finished.

    Return a ``WorkerVerdict`` to end the attempt (the built-in stall detector does when
    workers hang); the first answer wins. Must return within a fraction of a second: the
    agent's monitor loop waits for it.
    """


@hookspec
def elastic_annotate_failures(records: list[FailureRecord]) -> None:
    """Called with this node's failure records of an attempt before they are published
    job-wide and passed to ``elastic_worker_failed``: add what this plugin learnt (the
    built-ins add stacks, a stall, an expired FileTimer) to ``record.extra`` or
    ``record.message``."""


@hookspec
def elastic_worker_failed(record: FailureRecord) -> None:
    """Called once for each worker of this node that failed (not for workers the agent
    stopped itself because a sibling failed or membership changed)."""


@hookspec
def elastic_restart(group: WorkerGroup, reason: str) -> None:
    """Called when the agent stops its workers to start them again. ``reason`` is
    ``"failure"``, ``"membership"`` (a node arrived), ``"lost_node"``, ``"fenced"``,
    ``"store moved"`` (c10d's store moved while a store call whose outcome cannot be known
    was in flight) or ``"regroup_timeout"`` (workers that regroup in place did not take
    the new round in time). Workers kept through a regroup are not restarted: the agent then tells
    ``elastic_workers_started`` again, with the same pids."""


@hookspec
def elastic_membership_changed(old_world_size: int, new_world_size: int, round: int) -> None:
    """Called when a new round has a different number of nodes than the previous one."""


@hookspec
def elastic_run_failed(summary: FailureSummary) -> None:
    """Called once when the run failed for good, with the job-wide root cause first."""


@hookspec
def elastic_run_end(result: RunResult, duration: float) -> None:
    """Called once when the agent's run is over, succeeded or not."""
