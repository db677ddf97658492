"""``ElasticConfig``: what every hook plugin is told about the launch, typed and frozen.

The core options a plugin may need (the run id, the node counts, the backend, the log
directory, ...) plus ``plugin_options``: the values of the options plugins added with
``elastic_addoption``, by ``dest`` (``--error-summary`` -> ``"error_summary"``). Built
once per agent by ``LaunchConfig.plugin_config`` (``elastic run``, ``elastic_launch``)
or, for a bare ``LocalElasticAgent``, from its ``WorkerSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.core.interfaces.rendezvous import RendezvousHandler
    from elastic.core.interfaces.spec import WorkerSpec


@dataclass(frozen=True)
class ElasticConfig:
    """The launch as hook plugins see it; ``option(dest)`` reads a plugin option."""

    role: str = "default"
    nproc_per_node: int = 1
    run_id: str = "none"
    min_nodes: int | None = None  # None: not known (a bare agent)
    max_nodes: int | None = None
    rdzv_backend: str = "standalone"
    rdzv_endpoint: str = ""
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    local_addr: str | None = None
    event_log_handler: str = "null"  # --event-log-handler: "console" asks for agent events
    plugin_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Frozen all the way down: a plugin cannot change what the others see.
        object.__setattr__(self, "plugin_options", MappingProxyType(dict(self.plugin_options)))

    def option(self, dest: str, default: Any = None) -> Any:
        """The value of a plugin option (``default`` when no plugin declared it)."""
        value = self.plugin_options.get(dest)
        return default if value is None else value

    @classmethod
    def from_spec(cls, spec: WorkerSpec, handler: RendezvousHandler) -> ElasticConfig:
        """For an agent created without a launch configuration (the Python API)."""
        return cls(
            role=spec.role,
            nproc_per_node=spec.local_world_size,
            run_id=handler.get_run_id(),
            rdzv_backend=handler.get_backend(),
            max_restarts=spec.max_restarts,
            monitor_interval=spec.monitor_interval,
            start_method=spec.start_method,
            log_dir=spec.log_dir,
            local_addr=spec.local_addr,
        )
