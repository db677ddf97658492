"""Hook plugin ``event_log``: what torchrun's ``--event-log-handler=console`` shows.

One JSON object a line on stderr (through the ``elastic`` logger) for each agent event,
in the shape torchrun's console event handler logs (``name``, ``source``, ``timestamp``
in ms, ``metadata``). Silent unless the flag asks for it (``null``, the default). The
flag is a core flag of ``elastic run`` (it is torchrun's, so it exists whether or not this
plugin loads) and reaches the plugin as ``ElasticConfig.event_log_handler``; from Python,
``LaunchConfig(event_log_handler="console")`` (or, as before, ``plugin_options``). One
``EventLogPlugin`` per agent.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from elastic.core.log import say
from elastic.core.plugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord
    from elastic.core.interfaces.rendezvous import RendezvousInfo
    from elastic.core.interfaces.spec import RunResult, WorkerGroup, WorkerSpec
    from elastic.core.plugin.config import ElasticConfig


class EventLogPlugin:
    """Agent events as torchrun's console event handler prints them."""

    def __init__(self) -> None:
        self.enabled = False

    def emit(self, name: str, **metadata: Any) -> None:
        if self.enabled:
            event = {
                "name": f"torchelastic.{name}",
                "source": "AGENT",
                "timestamp": int(time.time() * 1000),
                "metadata": metadata,
            }
            say(json.dumps(event, default=str))

    @hookimpl
    def elastic_agent_start(self, spec: WorkerSpec, config: ElasticConfig) -> None:
        self.enabled = "console" in (config.event_log_handler, config.option("event_log_handler"))
        self.emit("agent.start", role=spec.role, local_world_size=spec.local_world_size)

    @hookimpl
    def elastic_rendezvous_complete(self, info: RendezvousInfo, duration: float) -> None:
        self.emit(
            "rendezvous.complete",
            round=info.round,
            group_rank=info.rank,
            group_world_size=info.world_size,
            duration=round(duration, 4),
        )

    @hookimpl
    def elastic_workers_started(self, group: WorkerGroup) -> None:
        self.emit(
            "workers.started",
            round=group.round,
            restart_count=group.restart_count,
            pids=[w.pid for w in group.workers],
        )

    @hookimpl
    def elastic_worker_failed(self, record: FailureRecord) -> None:
        self.emit(
            "worker.failed", rank=record.rank, exit_code=record.exit_code, signal=record.signal
        )

    @hookimpl
    def elastic_restart(self, group: WorkerGroup, reason: str) -> None:
        self.emit("workers.restart", reason=reason, restart_count=group.restart_count)

    @hookimpl
    def elastic_membership_changed(
        self, old_world_size: int, new_world_size: int, round: int
    ) -> None:
        self.emit("membership.changed", old=old_world_size, new=new_world_size, round=round)

    @hookimpl
    def elastic_run_end(self, result: RunResult, duration: float) -> None:
        self.emit(
            "run.end", state=result.state.value, exit_code=result.exit_code, duration=duration
        )
