"""Hook plugin ``event_log``: torchrun's ``--event-log-handler=console``.

One JSON object a line on stderr for each agent event, in the shape torchrun's console
event handler logs (``name``, ``source``, ``timestamp`` in ms, ``metadata``). Silent
unless the flag asks for it (``null``, the default).
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from elastic.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from elastic.core.failures import FailureRecord
    from elastic.core.rendezvous import RendezvousInfo
    from elastic.core.spec import RunResult, WorkerGroup, WorkerSpec

_enabled = False


def emit(name: str, **metadata: Any) -> None:
    if _enabled:
        event = {
            "name": f"torchelastic.{name}",
            "source": "AGENT",
            "timestamp": int(time.time() * 1000),
            "metadata": metadata,
        }
        print(json.dumps(event, default=str), file=sys.stderr, flush=True)


@hookimpl
def elastic_agent_start(spec: WorkerSpec, settings: dict[str, object]) -> None:
    global _enabled
    _enabled = settings.get("event_log_handler") == "console"
    emit("agent.start", role=spec.role, local_world_size=spec.local_world_size)


@hookimpl
def elastic_rendezvous_complete(info: RendezvousInfo, duration: float) -> None:
    emit(
        "rendezvous.complete",
        round=info.round,
        group_rank=info.rank,
        group_world_size=info.world_size,
        duration=round(duration, 4),
    )


@hookimpl
def elastic_workers_started(group: WorkerGroup) -> None:
    emit(
        "workers.started",
        round=group.round,
        restart_count=group.restart_count,
        pids=[w.pid for w in group.workers],
    )


@hookimpl
def elastic_worker_failed(record: FailureRecord) -> None:
    emit("worker.failed", rank=record.rank, exit_code=record.exit_code, signal=record.signal)


@hookimpl
def elastic_restart(group: WorkerGroup, reason: str) -> None:
    emit("workers.restart", reason=reason, restart_count=group.restart_count)


@hookimpl
def elastic_membership_changed(old_world_size: int, new_world_size: int, round: int) -> None:
    emit("membership.changed", old=old_world_size, new=new_world_size, round=round)


@hookimpl
def elastic_run_end(result: RunResult, duration: float) -> None:
    emit("run.end", state=result.state.value, exit_code=result.exit_code, duration=duration)
