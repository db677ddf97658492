"""``LaunchConfig``: the one description of a launch. ``elastic run`` fills it from its
options, the Python API takes it as torch's ``LaunchConfig``; ``views`` turns it into the
workers' ``WorkerSpec``, the rendezvous's ``RendezvousParameters`` and the plugins'
``ElasticConfig``.

A configuration is checked where it is made and again where it is launched (it is a
plain mutable dataclass), by ``validate``: a value out of range is a ``SettingError``
(a ValueError) naming the field and what would be right, whichever way the launch came.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic.core.interfaces.spec import SettingError, check_settings
from elastic.core.rendezvous.local import BACKEND as STANDALONE_BACKEND
from elastic.core.workers.process import DEFAULT_SIGNALS

__all__ = ["LaunchConfig", "SettingError", "per_local_rank", "signal_name"]

EVENT_LOG_HANDLERS = ("null", "console")  # torch's names that mean something here


@dataclass
class LaunchConfig:
    """Everything ``elastic run`` decides before an agent starts (torch's field names)."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str = "none"
    role: str = "default"
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    # One node, no server (``LocalRendezvousHandler``): the backend then reads
    # "standalone" and the endpoint is empty, whatever was given (``validate``).
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
    stall_timeout: float | None = None  # --stall-timeout (core/watchdog/stall.py); None: off
    health_port: int | None = None  # --health-port PORT (core/watchdog/health.py); None: off
    preemption_signal: str = "SIGTERM"  # --preemption-signal (core/agent/checkpoint_on_notice.py)
    preemption_grace: float = 25.0  # --preemption-grace SECONDS; 0: leave at once
    quiet: bool = False  # --quiet: no progress lines (waiting for nodes, round changes)
    event_log_handler: str = "null"  # torch's field: console writes agent events (event_log)
    numa_binding: str | None = None  # --numa-binding MODE (core/workers/numa.py); None: off
    warm_restarts: bool = False  # --warm-restarts: restarts start in spares (workers/spare.py)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``SettingError`` for the first field out of range; spell the preemption
        signal as ``signal`` does (``term`` -> ``SIGTERM``); name a standalone launch's
        backend (here only: the CLI, the Python API and the plugins read it from here)."""
        if self.min_nodes < 1:
            raise SettingError("min_nodes", f"{self.min_nodes} nodes; expected 1 or more")
        if self.max_nodes < self.min_nodes:
            raise SettingError(
                "max_nodes", f"{self.max_nodes} is below min_nodes ({self.min_nodes})"
            )
        check_settings(
            nproc_per_node=self.nproc_per_node,
            max_restarts=self.max_restarts,
            monitor_interval=self.monitor_interval,
            stall_timeout=self.stall_timeout,
            preemption_grace=self.preemption_grace,
        )
        if self.health_port is not None and not 1 <= self.health_port <= 65535:
            raise SettingError(
                "health_port", f"{self.health_port} is not a port; expected 1..65535"
            )
        if self.event_log_handler not in EVENT_LOG_HANDLERS:
            raise SettingError(
                "event_log_handler",
                f"{self.event_log_handler!r}: expected {' or '.join(EVENT_LOG_HANDLERS)}",
            )
        name = signal_name(self.preemption_signal)
        if name is None:
            raise SettingError(
                "preemption_signal", f"{self.preemption_signal!r} is not a signal name"
            )
        self.preemption_signal = name
        if self.standalone:
            self.rdzv_backend, self.rdzv_endpoint = STANDALONE_BACKEND, ""


def signal_name(name: str) -> str | None:
    """``term``, ``SIGTERM`` -> ``SIGTERM``; None when ``signal`` has no such name."""
    spelled = name.strip().upper()
    if not spelled.startswith("SIG"):
        spelled = "SIG" + spelled
    return spelled if hasattr(signal, spelled) else None


def per_local_rank(value: int | Mapping[int, int], nproc: int) -> dict[int, int]:
    """``--redirects``/``--tee``: one value for every local rank (torch's ``Std``) or a map."""
    return {rank: int(value) for rank in range(nproc)} if isinstance(value, int) else dict(value)
