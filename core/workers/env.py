"""Ranks and the environment every worker sees: exactly torchrun 2.13's variables.

Scripts written for torchrun read these names (``LOCAL_RANK``, ``RANK``, ``MASTER_PORT``
...), and ``torch.distributed.init_process_group`` reads them too, so the names and their
values follow ``LocalElasticAgent._start_workers`` of torch 2.13.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from string import Template

from elastic.core.interfaces.spec import Worker, WorkerGroup, WorkerSpec


def assign_ranks(spec: WorkerSpec, group_rank: int, group_world_size: int) -> list[Worker]:
    """This node's workers for a round. Every node runs ``local_world_size`` workers of
    the one role, so global and role ranks are ``group_rank * local_world_size + i``."""
    lws = spec.local_world_size
    world_size = group_world_size * lws
    return [
        Worker(
            local_rank=i,
            global_rank=group_rank * lws + i,
            role_rank=group_rank * lws + i,
            world_size=world_size,
            role_world_size=world_size,
        )
        for i in range(lws)
    ]


def worker_vars(
    group: WorkerGroup,
    worker: Worker,
    *,
    run_id: str,
    use_agent_store: bool,
    error_file: str,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables the agent sets for one worker (on top of the inherited env)."""
    environ = os.environ if environ is None else environ
    spec = group.spec
    env = {
        "LOCAL_RANK": str(worker.local_rank),
        "RANK": str(worker.global_rank),
        "GROUP_RANK": str(group.group_rank),
        "ROLE_RANK": str(worker.role_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "WORLD_SIZE": str(worker.world_size),
        "GROUP_WORLD_SIZE": str(group.group_world_size),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": str(group.master_addr),
        "MASTER_PORT": str(group.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(group.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": error_file,
    }
    if "CUDA_VISIBLE_DEVICES" in environ:
        env["CUDA_VISIBLE_DEVICES"] = environ["CUDA_VISIBLE_DEVICES"]
    if spec.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = visible_gpu(worker.local_rank, environ)
    return env


def visible_gpu(local_rank: int, environ: Mapping[str, str]) -> str:
    """The one GPU a worker sees with --virtual-local-rank, mapped through the agent's
    own CUDA_VISIBLE_DEVICES as torchrun does."""
    parent = environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return str(local_rank)
    gpus = [g.strip() for g in parent.split(",")]
    if local_rank >= len(gpus):
        raise ValueError(f"local rank {local_rank} has no GPU in CUDA_VISIBLE_DEVICES={parent}")
    return gpus[local_rank]


def substitute_args(args: tuple[str, ...], local_rank: int) -> tuple[str, ...]:
    """torchrun's ``${local_rank}`` macro in the script arguments."""
    return tuple(
        Template(a).safe_substitute(local_rank=str(local_rank)) if isinstance(a, str) else a
        for a in args
    )
