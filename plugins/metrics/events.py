"""Hook plugin (``elastic.plugins`` entry point ``metrics``): the agent's lifecycle as metrics.

It owns ``--metrics-sink NAME[:ARG][,...]`` (also ``ELASTIC_METRICS_SINK``). Each agent
gets its own ``MetricsPlugin``, which opens its own sinks at ``elastic_agent_start`` and
closes them at ``elastic_run_end``; it hands workers the resolved spec through
``elastic_worker_env`` (``ELASTIC_METRICS_SINK``, file sinks with absolute paths) so
``put_metric`` in user code reaches the same sinks without a plugin scan.

Metric names (group ``torchelastic``):

- ``rendezvous.duration_seconds``, ``rendezvous.round``, ``rendezvous.world_size``
- ``workers.started`` (number of local workers), ``workers.restarts`` (restarts spent)
- ``workers.failed`` (1 per failed worker), ``workers.failed.exit_code``
- ``restart`` (1 per restart) and ``restart.<reason>`` (failure, membership, lost_node)
- ``membership.changed`` (1), ``membership.world_size`` (new number of nodes)
- ``run.duration_seconds``, ``run.succeeded`` (1 or 0), ``run.exit_code``

``rendezvous.duration``, ``workers.restart_count`` and ``run.duration``, the names before
Prometheus's conventions were followed, are emitted beside them as deprecated aliases
for one release.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from elastic.core import metrics
from elastic.core.plugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord
    from elastic.core.interfaces.rendezvous import RendezvousInfo
    from elastic.core.interfaces.spec import RunResult, WorkerGroup, WorkerSpec
    from elastic.core.plugin.config import ElasticConfig
    from elastic.core.plugin.options import PluginOptionParser


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


class MetricsPlugin:
    """This agent's sinks and the lifecycle metrics it puts into them."""

    def __init__(self) -> None:
        self.sinks = metrics.SinkManager()
        self.worker_sink_spec = ""

    def put(self, name: str, value: float) -> None:
        if self.sinks.sinks:
            for data in metrics.observations(name, value):
                self.sinks.emit(data)

    @hookimpl
    def elastic_addoption(self, parser: PluginOptionParser) -> None:
        parser.addoption(
            "--metrics-sink",
            metavar="NAME[:ARG],...",
            type=metrics.validate_sink_names,
            help="Metrics sinks, NAME[:ARG][,NAME[:ARG]] (console, jsonl, prometheus).",
        )

    @hookimpl
    def elastic_agent_start(self, spec: WorkerSpec, config: ElasticConfig) -> None:
        self.sinks.close()
        self.sinks, self.worker_sink_spec = metrics.SinkManager(), ""
        sink_spec = config.option("metrics_sink") or os.environ.get(metrics.ENV_SINK) or ""
        if not sink_spec:
            return
        if spec.log_dir:  # default home for file sinks; an explicit env setting still wins
            os.environ.setdefault("ELASTIC_METRICS_DIR", str(spec.log_dir))
        self.sinks = metrics.SinkManager(metrics.build_sinks(sink_spec))
        self.worker_sink_spec = worker_spec(self.sinks, sink_spec)

    @hookimpl
    def elastic_worker_env(self, config: ElasticConfig) -> dict[str, str] | None:
        return {metrics.ENV_SINK: self.worker_sink_spec} if self.worker_sink_spec else None

    @hookimpl
    def elastic_rendezvous_complete(self, info: RendezvousInfo, duration: float) -> None:
        self.put("rendezvous.duration_seconds", duration)
        self.put("rendezvous.round", info.round)
        self.put("rendezvous.world_size", info.world_size)

    @hookimpl
    def elastic_workers_started(self, group: WorkerGroup) -> None:
        self.put("workers.started", len(group.workers))
        self.put("workers.restarts", group.restart_count)

    @hookimpl
    def elastic_worker_failed(self, record: FailureRecord) -> None:
        self.put("workers.failed", 1)
        self.put("workers.failed.exit_code", record.exit_code)

    @hookimpl
    def elastic_restart(self, group: WorkerGroup, reason: str) -> None:
        self.put("restart", 1)
        self.put(f"restart.{reason}", 1)

    @hookimpl
    def elastic_membership_changed(
        self, old_world_size: int, new_world_size: int, round: int
    ) -> None:
        self.put("membership.changed", 1)
        self.put("membership.world_size", new_world_size)

    @hookimpl
    def elastic_run_end(self, result: RunResult, duration: float) -> None:
        self.put("run.duration_seconds", duration)
        self.put("run.succeeded", 0 if result.is_failed() else 1)
        self.put("run.exit_code", result.exit_code)
        self.sinks.close()  # flush and close files: the run is over
