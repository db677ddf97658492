"""What the agent runs: the worker specification, the workers and the run's result."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord
    from elastic.core.interfaces.rendezvous import RendezvousHandler


class WorkerState(str, enum.Enum):
    """The state of a local worker group (and of each worker in it)."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        return state in {WorkerState.HEALTHY, WorkerState.UNHEALTHY}


@dataclass
class WorkerSpec:
    """Everything needed to start one node's workers, the same on every attempt.

    ``entrypoint`` is either a command (``sys.executable`` or a program path) followed by
    ``args``, or a Python callable that is started with ``start_method`` and called with
    ``*args``.
    """

    role: str
    local_world_size: int
    entrypoint: str | Callable[..., Any]
    args: tuple[str, ...] = ()
    rdzv_handler: RendezvousHandler | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1
    redirects: dict[int, int] = field(default_factory=dict)  # local_rank -> Std flags
    tee: dict[int, int] = field(default_factory=dict)  # local_rank -> Std flags
    local_ranks_filter: frozenset[int] | None = None  # None means every local rank
    log_dir: str | None = None
    local_addr: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    start_method: str = "spawn"
    shutdown_timeout: float = 30.0
    extra_env: dict[str, str] = field(default_factory=dict)
    virtual_local_rank: bool = False  # LOCAL_RANK=0, one visible GPU per worker
    duplicate_stdout_filters: tuple[str, ...] = ()  # teed lines copied to filtered_stdout.log
    duplicate_stderr_filters: tuple[str, ...] = ()
    stall_timeout: float | None = None  # --stall-timeout: restart a job that stops progressing
    health_port: int | None = None  # --health-port: /healthz, /readyz, /metrics (watchdog/health)
    # --preemption-signal/--preemption-grace: a checkpoint on notice (agent/checkpoint_on_notice)
    preemption_signal: str = "SIGTERM"
    preemption_grace: float = 25.0

    def __post_init__(self) -> None:
        if self.local_world_size <= 0:
            raise ValueError(f"local_world_size must be positive, got {self.local_world_size}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.monitor_interval <= 0:
            raise ValueError(f"monitor_interval must be positive, got {self.monitor_interval}")
        if not self.preemption_grace >= 0:
            raise ValueError(f"preemption_grace must be >= 0, got {self.preemption_grace}")
        if self.stall_timeout is not None and self.stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be positive, got {self.stall_timeout}")


@dataclass
class Worker:
    """One worker process of one attempt."""

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    pid: int | None = None


@dataclass
class WorkerGroup:
    """This node's workers for the current attempt and the rendezvous that placed them."""

    spec: WorkerSpec
    workers: list[Worker] = field(default_factory=list)
    state: WorkerState = WorkerState.INIT
    group_rank: int | None = None
    group_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    round: int = 0


@dataclass
class RunResult:
    """How a run ended: per local rank return values (callables) or failures."""

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, FailureRecord] = field(default_factory=dict)
    exit_code: int = 0
    message: str = ""

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED
