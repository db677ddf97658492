"""``elastic.init_process_group``: the process group for a worker started by elastic."""

from __future__ import annotations

import datetime
import os
from typing import Any

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    backend: str | None = None,
    timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> str:
    """Initialize ``torch.distributed`` from the launcher's environment; returns the backend.

    ``backend`` defaults to nccl when CUDA is available, else gloo. With nccl the current
    device is set to ``LOCAL_RANK`` first, so each worker gets its own GPU. ``timeout``
    (a timedelta or seconds) bounds each collective: 5 minutes by default rather than
    torch's 10-30, because a worker stuck on a dead peer only delays the restart that
    brings the job back. Calling it again once initialized is a no-op.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return str(dist.get_backend())
    missing = [name for name in _REQUIRED if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_process_group: {', '.join(missing)} not set; start this script with "
            "`elastic run` (or torchrun)"
        )
    backend = backend or default_backend()
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    # Importing torch._dynamo while a process group exists keeps that group alive after
    # destroy_process_group (torch 2.13), and the first optimizer a script creates
    # imports it. The group is then torn down during interpreter finalization, where a
    # gloo thread taking the GIL aborts the worker (SIGABRT, "terminate called without
    # an active exception") after a successful run. Importing it first avoids that.
    import torch._dynamo  # noqa: F401

    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://", timeout=timeout, **kwargs)
    return backend
