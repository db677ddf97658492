"""Starting one attempt's workers: the round's ranks placed on this node's group, then
one process per worker with torchrun's variables and the plugins' additions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from elastic.core.interfaces.rendezvous import RendezvousInfo
from elastic.core.interfaces.spec import WorkerGroup
from elastic.core.workers.env import assign_ranks, substitute_args, worker_vars
from elastic.core.workers.logs import WorkerLogs
from elastic.core.workers.process import WorkerProcess, start_worker

if TYPE_CHECKING:
    from elastic.core.workers.spare import SparePool


def place_group(group: WorkerGroup, info: RendezvousInfo, restarts: int) -> None:
    """This node's share of the round: its rank, the world, the workers' global ranks."""
    group.group_rank, group.group_world_size = info.rank, info.world_size
    group.master_addr, group.master_port = info.master_addr, info.master_port
    group.restart_count, group.round = restarts, info.round
    group.workers = assign_ranks(group.spec, info.rank, info.world_size)


def start_workers(
    group: WorkerGroup,
    logs: Mapping[int, WorkerLogs],
    *,
    run_id: str,
    use_agent_store: bool,
    extra_env: Mapping[str, str],
    process_env: Callable[[int, str], dict[str, str]],
    started: list[WorkerProcess],
    spares: SparePool | None = None,
) -> None:
    """Start every worker of ``group``, appending each process to ``started`` as it
    starts, so a failure part-way (``OSError``, ``ValueError``) leaves none untracked.
    ``process_env(local_rank, error_file)``: what plugins add for that worker."""
    spec = group.spec
    for worker in group.workers:
        rank_logs = logs[worker.local_rank]
        env = worker_vars(
            group,
            worker,
            run_id=run_id,
            use_agent_store=use_agent_store,
            error_file=rank_logs.error_file,
        )
        env.update(process_env(worker.local_rank, rank_logs.error_file))
        args = substitute_args(spec.args, worker.local_rank)
        proc = start_worker(spec, worker.local_rank, args, env, dict(extra_env), rank_logs, spares)
        worker.pid = proc.pid
        started.append(proc)
