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


class SettingError(ValueError):
    """A launch setting out of range. ``field`` names it as the configuration spells it
    and the message says what would be right: ``elastic run`` shows ``reason`` under the
    option's name (one line, exit 2), the Python API raises it as the ValueError it is."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# The ranges a worker spec and a launch configuration share, stated once: name -> (is it
# in range, what would be right). ``nproc_per_node`` is the launch's ``local_world_size``.
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "local_world_size": (lambda v: v >= 1, "{value} workers per node; expected 1 or more"),
    "nproc_per_node": (lambda v: v >= 1, "{value} workers per node; expected 1 or more"),
    "max_restarts": (lambda v: v >= 0, "{value} is negative; expected 0 or more"),
    "monitor_interval": (lambda v: v > 0, "expected a positive number of seconds"),
    "stall_timeout": (lambda v: v is None or v > 0, "expected a positive number of seconds"),
    "preemption_grace": (
        lambda v: v >= 0,
        "expected a number of seconds >= 0 (0: leave at once)",
    ),
}


def check_settings(**settings: Any) -> None:
    """Raise ``SettingError`` for the first setting outside its range in ``RANGES``."""
    for name, value in settings.items():
        in_range, expected = RANGES[name]
        if not in_range(value):
            raise SettingError(name, expected.format(value=value))


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
    numa_binding: str | None = None  # --numa-binding MODE: each worker's CPUs (workers/numa.py)
    warm_restarts: bool = False  # --warm-restarts: a spare per local rank (workers/spare.py)

    def __post_init__(self) -> None:
        check_settings(
            local_world_size=self.local_world_size,
            max_restarts=self.max_restarts,
            monitor_interval=self.monitor_interval,
            preemption_grace=self.preemption_grace,
            stall_timeout=self.stall_timeout,
        )


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
