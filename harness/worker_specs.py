"""``WorkerSpec``s for tests that drive an agent in-process."""

from __future__ import annotations

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
