"""Hook plugin (``elastic.plugins`` entry point ``metrics``): the agent's lifecycle as metrics.

``elastic_agent_start`` configures this process's sinks from ``settings["metrics_sink"]``
and passes the resolved spec to workers in ``ELASTIC_METRICS_SINK`` (via
``spec.extra_env``) so ``put_metric`` in user code reaches the same sinks without a
plugin scan. Every other hook only calls ``put_metric``, which is a no-op without sinks.

Metric names (group ``torchelastic``):

- ``rendezvous.duration`` (s), ``rendezvous.round``, ``rendezvous.world_size``
- ``workers.started`` (number of local workers), ``workers.restart_count``
- ``workers.failed`` (1 per failed worker), ``workers.failed.exit_code``
- ``restart`` (1 per restart) and ``restart.<reason>`` (failure, membership, lost_node)
- ``membership.changed`` (1), ``membership.world_size`` (new number of nodes)
- ``run.duration`` (s), ``run.succeeded`` (1 or 0), ``run.exit_code``
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from elastic.core import metrics
from elastic.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from elastic.core.failures import FailureRecord
    from elastic.core.rendezvous import RendezvousInfo
    from elastic.core.spec import RunResult, WorkerGroup, WorkerSpec

put = metrics.put_metric


def worker_spec(manager: metrics.SinkManager, spec: str) -> str:
    """The spec for workers: file sinks get their resolved absolute path, so workers write
    where the agent does whatever their cwd or env."""
    names = [name for name, _ in metrics.parse_sink_spec(spec)]
    args = dict(metrics.parse_sink_spec(spec))
    paths = {name: getattr(sink, "path", None) for name, sink in manager.sinks}
    parts = []
    for name in dict.fromkeys(names):
        path = paths.get(name) or args.get(name)
        parts.append(f"{name}:{path}" if path else name)
    return ",".join(parts)


@hookimpl
def elastic_agent_start(spec: WorkerSpec, settings: dict[str, object]) -> None:
    sink_spec = settings.get("metrics_sink") or os.environ.get(metrics.ENV_SINK) or ""
    if not isinstance(sink_spec, str) or not sink_spec:
        metrics.configure_sinks(None)
        return
    if spec.log_dir:  # default home for file sinks; an explicit env setting still wins
        os.environ.setdefault("ELASTIC_METRICS_DIR", str(spec.log_dir))
    manager = metrics.configure_sinks(sink_spec)
    spec.extra_env[metrics.ENV_SINK] = worker_spec(manager, sink_spec)


@hookimpl
def elastic_rendezvous_complete(info: RendezvousInfo, duration: float) -> None:
    put("rendezvous.duration", duration)
    put("rendezvous.round", info.round)
    put("rendezvous.world_size", info.world_size)


@hookimpl
def elastic_workers_started(group: WorkerGroup) -> None:
    put("workers.started", len(group.workers))
    put("workers.restart_count", group.restart_count)


@hookimpl
def elastic_worker_failed(record: FailureRecord) -> None:
    put("workers.failed", 1)
    put("workers.failed.exit_code", record.exit_code)


@hookimpl
def elastic_restart(group: WorkerGroup, reason: str) -> None:
    put("restart", 1)
    put(f"restart.{reason}", 1)


@hookimpl
def elastic_membership_changed(old_world_size: int, new_world_size: int, round: int) -> None:
    put("membership.changed", 1)
    put("membership.world_size", new_world_size)


@hookimpl
def elastic_run_end(result: RunResult, duration: float) -> None:
    put("run.duration", duration)
    put("run.succeeded", 0 if result.is_failed() else 1)
    put("run.exit_code", result.exit_code)
    metrics.close_sinks()  # flush and close files: the run is over
