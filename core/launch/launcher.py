"""From a launch configuration to a finished run: pick the rendezvous, build the
worker spec, run the agent. The programmatic twin of ``elastic run``."""

from __future__ import annotations

import os
import runpy
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.core.interfaces.rendezvous import RendezvousHandler, RendezvousParameters
from elastic.core.interfaces.spec import RunResult, WorkerSpec
from elastic.core.plugin.config import ElasticConfig
from elastic.core.workers.process import DEFAULT_SIGNALS

if TYPE_CHECKING:
    from elastic.core.agent.loop import LocalElasticAgent
    from elastic.core.plugin.host import PluginHost
    from elastic.core.rendezvous.registry import HandlerFactory


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
    redirects: int | dict[int, int] = field(default_factory=dict)  # one Std value or per rank
    tee: int | dict[int, int] = field(default_factory=dict)
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
    rdzv_timeout: int = -1  # torch's field: seconds a rendezvous may take (-1: the backend's)
    plugin_options: dict[str, Any] = field(default_factory=dict)  # by dest, see elastic_addoption
    stall_timeout: float | None = (
        None  # --stall-timeout SECONDS (core/watchdog/stall.py); None: off
    )
    health_port: int | None = None  # --health-port PORT (core/watchdog/health.py); None: off
    preemption_signal: str = "SIGTERM"  # --preemption-signal (core/agent/checkpoint_on_notice.py)
    preemption_grace: float = 25.0  # --preemption-grace SECONDS; 0: leave at once
    quiet: bool = False  # --quiet: no progress lines (waiting for nodes, round changes)

    def plugin_config(self, plugin_options: Mapping[str, Any], run_id: str) -> ElasticConfig:
        """What hook plugins are told about this launch. ``run_id``: the rendezvous
        handler's (a backend may fill in the job id itself)."""
        return ElasticConfig(
            role=self.role,
            nproc_per_node=self.nproc_per_node,
            run_id=run_id or self.run_id,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            rdzv_backend="standalone" if self.standalone else self.rdzv_backend,
            rdzv_endpoint=self.rdzv_endpoint,
            max_restarts=self.max_restarts,
            monitor_interval=self.monitor_interval,
            start_method=self.start_method,
            log_dir=self.log_dir,
            local_addr=self.local_addr,
            plugin_options=plugin_options,
        )


def run_script_path(script: str, *args: str) -> None:
    """``--run-path``: run a script in the worker's interpreter as ``__main__``."""
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def create_handler(
    config: LaunchConfig, factory: HandlerFactory | None = None
) -> RendezvousHandler:
    """The rendezvous for this launch; a single node without a server needs no plugin.

    ``factory`` is the backend the caller already resolved (``elastic run`` checks the
    name before anything starts), so a launch looks its backend up once."""
    if config.standalone:
        from elastic.core.rendezvous.local import LocalRendezvousHandler

        return LocalRendezvousHandler(run_id=config.run_id, local_addr=config.local_addr)
    if factory is None:
        from elastic.core.rendezvous.registry import get_backend_factory

        factory = get_backend_factory(config.rdzv_backend)
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
    return factory(params)


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
        redirects=per_local_rank(config.redirects, config.nproc_per_node),
        tee=per_local_rank(config.tee, config.nproc_per_node),
        local_ranks_filter=config.local_ranks_filter,
        log_dir=config.log_dir,
        local_addr=config.local_addr,
        start_method=config.start_method,
        shutdown_timeout=config.shutdown_timeout,
        extra_env=dict(config.extra_env),
        virtual_local_rank=config.virtual_local_rank,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        stall_timeout=config.stall_timeout,
        health_port=config.health_port,
        preemption_signal=config.preemption_signal,
        preemption_grace=config.preemption_grace,
    )


def per_local_rank(value: int | dict[int, int], nproc: int) -> dict[int, int]:
    """``--redirects``/``--tee``: one value for every local rank (torch's ``Std``) or a map."""
    return {rank: int(value) for rank in range(nproc)} if isinstance(value, int) else dict(value)


def plugin_option_values(host: PluginHost, given: dict[str, Any]) -> dict[str, Any]:
    """Every plugin option's value: ``given`` (checked and converted) over the defaults.

    A name no installed plugin declares is a ValueError listing the known ones."""
    options = {o.dest: o for o in host.options()}
    unknown = sorted(set(given) - set(options))
    if unknown:
        known = ", ".join(sorted(options)) or "none"
        raise ValueError(f"unknown plugin option(s) {', '.join(unknown)}; known: {known}")
    values = {dest: option.default for dest, option in options.items()}
    for dest, value in given.items():
        try:
            values[dest] = options[dest].parse(value)
        except ValueError as exc:
            raise ValueError(f"plugin option {dest}: {exc}") from None
    return values


def create_agent(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    plugin_host: PluginHost | None = None,
    handler_factory: HandlerFactory | None = None,
) -> LocalElasticAgent:
    """The agent for this node: its rendezvous, worker spec, plugins and their config.

    ``plugin_host`` defaults to one with the installed hook plugins."""
    from elastic.core.agent.loop import LocalElasticAgent
    from elastic.core.plugin.host import PluginHost

    host = plugin_host if plugin_host is not None else PluginHost()
    options = plugin_option_values(host, config.plugin_options)
    if config.standalone and config.run_id == "none":
        config.run_id = str(uuid.uuid4())
    handler = create_handler(config, handler_factory)
    spec = make_spec(config, entrypoint, args, handler)
    return LocalElasticAgent(
        spec,
        plugin_host=host,
        config=config.plugin_config(options, handler.get_run_id()),
        signals_to_handle=config.signals_to_handle,
        quiet=config.quiet,
    )


def launch(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    plugin_host: PluginHost | None = None,
    handler_factory: HandlerFactory | None = None,
) -> RunResult:
    """Rendezvous, run this node's workers to completion and return the result."""
    agent = create_agent(
        config, entrypoint, args, plugin_host=plugin_host, handler_factory=handler_factory
    )
    return agent.run()


def python_exec() -> str:
    """The interpreter for workers: ``PYTHON_EXEC`` overrides, as in torchrun."""
    return os.environ.get("PYTHON_EXEC", sys.executable)
