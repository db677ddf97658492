"""``WorkerSpec``s and worker stand-ins for tests that drive an agent in-process."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from elastic.core.interfaces.spec import WorkerSpec


def make_spec(handler: Any, args: tuple[str, ...], nproc: int = 2, **kwargs: Any) -> WorkerSpec:
    """A WorkerSpec with test-friendly defaults: fast monitoring, short grace."""
    kwargs.setdefault("monitor_interval", 0.05)
    kwargs.setdefault("shutdown_timeout", 2.0)
    return WorkerSpec(
        role=kwargs.pop("role", "default"),
        local_world_size=nproc,
        entrypoint=kwargs.pop("entrypoint", sys.executable),
        args=args,
        rdzv_handler=handler,
        **kwargs,
    )


class SleepingWorker:
    """A real process in the agent's ``WorkerProcess`` shape: it sleeps ``seconds`` and
    exits with ``code`` (tests of the agent's watch and regroup waits)."""

    def __init__(self, seconds: float, code: int = 0, local_rank: int = 0) -> None:
        self.local_rank = local_rank
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({code})"]
        )
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def reap(self, timeout: float) -> int | None:
        return self.proc.wait(timeout)

    def return_value(self) -> Any:
        return None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
