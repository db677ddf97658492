"""What a plugin that watches running workers sees (``WorkerHandle``) and how it ends an
attempt (``WorkerVerdict``): the types of the ``elastic_check_workers`` hook."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


class WorkerHandle(Protocol):
    """One live worker process of this node, as the agent started it."""

    local_rank: int
    pid: int

    def poll(self) -> int | None:
        """The exit code once the process is gone (negative: killed by that signal)."""


@dataclass(frozen=True)
class WorkerVerdict:
    """A plugin's ruling that this node's current attempt must end.

    ``failed`` maps the local ranks the plugin stopped as failed to (exit code, the unix
    time their trouble began, which orders the job-wide root cause); they are handled as
    a crash of those workers (records, one restart of the budget). Empty: nothing failed
    here, another node's trouble ends the attempt and that node spends the restart.
    """

    failed: Mapping[int, tuple[int, float]] = field(default_factory=dict)
