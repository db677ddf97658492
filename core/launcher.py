"""From a launch configuration to a finished run: pick the rendezvous, build the
worker spec, run the agent. The programmatic twin of ``elastic run``."""

from __future__ import annotations

import os
import runpy
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.core.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.core.spec import RunResult, WorkerSpec

DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@dataclass
class LaunchConfig:
    """Everything ``elastic run`` decides before an agent starts."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str = "none"
    role: str = "default"
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    local_addr: str | None = None
    node_rank: int | None = None  # --node-rank: static's rank, a dynamic backend's hint
    signals_to_handle: tuple[str, ...] = DEFAULT_SIGNALS
    shutdown_timeout: float = 30.0
    extra_env: dict[str, str] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)
    allow_mismatch: frozenset[str] = frozenset()
    virtual_local_rank: bool = False
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    settings: dict[str, object] = field(default_factory=dict)  # for elastic_agent_start


def run_script_path(script: str, *args: str) -> None:
    """``--run-path``: run a script in the worker's interpreter as ``__main__``."""
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def create_handler(config: LaunchConfig) -> RendezvousHandler:
    """The rendezvous for this launch; a single node without a server needs no plugin."""
    if config.standalone:
        from elastic.core.local_rendezvous import LocalRendezvousHandler

        return LocalRendezvousHandler(run_id=config.run_id, local_addr=config.local_addr)
    from elastic.core.registry import get_rendezvous_handler

    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        config=dict(config.rdzv_configs),
        fingerprint=dict(config.fingerprint),
        allow_mismatch=config.allow_mismatch,
        node_rank=config.node_rank,
    )
    return get_rendezvous_handler(params)


def make_spec(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[str, ...],
    handler: RendezvousHandler,
) -> WorkerSpec:
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        redirects=dict(config.redirects),
        tee=dict(config.tee),
        local_ranks_filter=config.local_ranks_filter,
        log_dir=config.log_dir,
        local_addr=config.local_addr,
        start_method=config.start_method,
        shutdown_timeout=config.shutdown_timeout,
        extra_env=dict(config.extra_env),
        virtual_local_rank=config.virtual_local_rank,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
    )


def launch(
    config: LaunchConfig, entrypoint: str | Callable[..., Any], args: tuple[str, ...] = ()
) -> RunResult:
    """Rendezvous, run this node's workers to completion and return the result."""
    from elastic.core.agent import LocalElasticAgent
    from elastic.core.plugins import plugin_host

    if config.standalone and config.run_id == "none":
        config.run_id = str(uuid.uuid4())
    handler = create_handler(config)
    spec = make_spec(config, entrypoint, args, handler)
    agent = LocalElasticAgent(
        spec,
        plugin_host=plugin_host(),
        settings=dict(config.settings),
        signals_to_handle=config.signals_to_handle,
    )
    return agent.run()


def python_exec() -> str:
    """The interpreter for workers: ``PYTHON_EXEC`` overrides, as in torchrun."""
    return os.environ.get("PYTHON_EXEC", sys.executable)
