"""torch's programmatic launch API: ``elastic_launch(config, entrypoint)(*args)``.

The same shapes as ``torch.distributed.launcher.api`` (``LaunchConfig`` with torch's
field names, ``elastic_launch``, ``launch_agent``, ``ChildFailedError``), running our
agent: one call runs this node's share of the job and returns ``{global rank: return
value}`` (None for each rank of a program). A failure raises ``ChildFailedError``
carrying every failure of this node and the root cause (the earliest). Installed hook
plugins are loaded as ``elastic run`` loads them; set their options with
``LaunchConfig(plugin_options={"metrics_sink": "jsonl:/tmp/m.jsonl"})``. A setting out
of range (``max_restarts=-1``) is a ValueError naming the field, raised when the
``LaunchConfig`` is made and again when it is launched.

``rdzv_backend="c10d", rdzv_endpoint="localhost:0"`` is torch's spelling of a one-node
job on a free port (``torchrun --standalone``): it runs the standalone rendezvous.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from elastic.core.launch.config import LaunchConfig
from elastic.core.launch.launcher import create_agent, python_exec

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord

__all__ = ["ChildFailedError", "LaunchConfig", "elastic_launch", "launch_agent"]

# ``rdzv_timeout`` goes to each backend's own key (torch sends "timeout" to all, which
# its c10d backend silently ignores; ours validate their keys).
TIMEOUT_KEYS = {"etcd": "timeout", "static": "timeout"}


class ChildFailedError(RuntimeError):
    """This node's workers failed for good (torch's ``ChildFailedError``).

    ``failures`` maps global ranks to their ``FailureRecord``; ``get_first_failure``
    returns the root cause (the earliest), ``exit_code`` is what ``elastic run`` exits
    with. ``failures`` is empty when the run failed without a worker failing (the
    rendezvous failed, the agent was signalled): ``message`` says why.
    """

    def __init__(
        self,
        name: str,
        failures: Mapping[int, FailureRecord],
        exit_code: int = 1,
        message: str = "",
    ) -> None:
        self.name = name
        self.failures = dict(failures)
        self.exit_code = exit_code
        self.message = message
        super().__init__(self._describe())

    def get_first_failure(self) -> tuple[int, FailureRecord]:
        rank = min(self.failures, key=lambda r: (self.failures[r].timestamp, r))
        return rank, self.failures[rank]

    @property
    def root_cause(self) -> FailureRecord | None:
        return self.get_first_failure()[1] if self.failures else None

    def _describe(self) -> str:
        if not self.failures:
            return f"{self.name} failed: {self.message or 'no worker failure was recorded'}"
        rank, first = self.get_first_failure()
        how = f"exited with code {first.exit_code}"
        if first.signal:
            how = f"was killed by {first.signal}"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first.timestamp))
        detail = first.message.strip().splitlines()[-1] if first.message.strip() else ""
        others = len(self.failures) - 1
        return (
            f"{self.name} failed: root cause rank {rank} (local rank {first.local_rank}, "
            f"host {first.host}, pid {first.pid}) {how} at {when}"
            + (f": {detail}" if detail else "")
            + (f" ({others} other failure{'s' if others > 1 else ''})" if others else "")
        )


def command_for(
    entrypoint: str | Callable[..., Any] | None, args: tuple[Any, ...]
) -> tuple[str | Callable[..., Any], tuple[Any, ...]]:
    """A callable runs as is; a ``.py`` file that is not executable runs with this
    interpreter (``PYTHON_EXEC`` overrides); any other string is a program, as in torch."""
    if entrypoint is None:
        raise ValueError("an entrypoint is required: a function, a script or a program")
    if callable(entrypoint):
        return entrypoint, args
    text_args = tuple(str(a) for a in args)
    if entrypoint.endswith(".py") and os.path.isfile(entrypoint):
        if not os.access(entrypoint, os.X_OK):
            return python_exec(), ("-u", entrypoint, *text_args)
    return entrypoint, text_args


def launch_config_for(config: LaunchConfig) -> LaunchConfig:
    """A copy of ``config`` with torch's conventions turned into ours."""
    c = dataclasses.replace(
        config,
        rdzv_configs=dict(config.rdzv_configs),
        plugin_options=dict(config.plugin_options),
    )
    if isinstance(c.signals_to_handle, str):  # torch's type: "SIGTERM,SIGINT,..."
        c.signals_to_handle = tuple(s.strip() for s in c.signals_to_handle.split(",") if s)
    if c.rdzv_timeout != -1:
        key = TIMEOUT_KEYS.get(c.rdzv_backend, "join_timeout")
        c.rdzv_configs.setdefault(key, str(c.rdzv_timeout))
    port = c.rdzv_endpoint.rpartition(":")[2] if ":" in c.rdzv_endpoint else ""
    if not c.standalone and c.rdzv_backend == "c10d" and port == "0":
        if c.max_nodes != 1:
            raise ValueError(
                f"rdzv_endpoint={c.rdzv_endpoint!r}: port 0 (a free port) is for one-node "
                f"jobs, but max_nodes={c.max_nodes}; give the port the other nodes reach"
            )
        c.standalone = True
    if c.run_id == "":
        c.run_id = "none"  # torch's default; a standalone run gets a fresh id
    return c


def launch_agent(
    config: LaunchConfig, entrypoint: str | Callable[..., Any] | None, args: list[Any]
) -> dict[int, Any]:
    """Run this node's agent to the end; ``{global rank: return value}`` of its workers."""
    config = launch_config_for(config)
    command, command_args = command_for(entrypoint, tuple(args))
    agent = create_agent(config, command, command_args)
    result = agent.run()
    if result.is_failed():
        name = getattr(entrypoint, "__qualname__", None) or str(entrypoint)
        raise ChildFailedError(name, result.failures, result.exit_code, result.message)
    return {
        w.global_rank: result.return_values.get(w.local_rank)
        for w in agent.get_worker_group().workers
    }


class elastic_launch:  # noqa: N801 - torch's name, used like a function
    """``elastic_launch(config, entrypoint)(*args)``: run ``entrypoint`` on this node as
    the ``config`` says and return ``{global rank: return value}``."""

    def __init__(
        self, config: LaunchConfig, entrypoint: str | Callable[..., Any] | None = None
    ) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))
