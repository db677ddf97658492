"""Run a real standalone agent with chosen hook plugins and record every hook call.

The ``elastic_agent_runner`` fixture (``elastic.testing.pytest_plugin``) hands out an
``AgentRunner``. ``run`` starts one node's agent in this process (real worker processes,
the standalone rendezvous, no server), with only the plugins you name: objects (a module,
an instance, or a class to instantiate), ``(name, object)`` pairs, or the names of
installed ``elastic.plugins`` entry points. Every hook call is recorded through pluggy's
call monitoring, with the plugins in the order pluggy called them::

    def test_my_plugin(elastic_agent_runner, tmp_path):
        run = elastic_agent_runner.run(
            "train.py", nproc=2, plugins=[MyPlugin], options={"my_flag": "x"}
        )
        assert run.exit_code == 0
        assert run.hook_names[0] == "elastic_addoption"
        (start,) = run.calls_to("elastic_agent_start")
        assert start.kwargs["config"].option("my_flag") == "x"
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.core.interfaces.spec import RunResult, WorkerSpec
from elastic.core.launch.config import LaunchConfig
from elastic.core.launch.launcher import create_agent
from elastic.core.plugin.config import ElasticConfig
from elastic.core.plugin.host import PluginHost
from elastic.core.plugin.trace import call_order


@dataclass
class HookCall:
    """One call of a hook: its arguments, the plugins called (in order) and the outcome."""

    name: str
    kwargs: dict[str, Any]
    plugins: list[str]
    result: Any = None
    error: BaseException | None = None


@dataclass
class AgentRun:
    """What one ``AgentRunner.run`` did."""

    result: RunResult
    calls: list[HookCall]
    host: PluginHost
    spec: WorkerSpec
    config: ElasticConfig = field(default_factory=ElasticConfig)

    @property
    def exit_code(self) -> int:
        return self.result.exit_code

    @property
    def return_values(self) -> dict[int, Any]:
        return self.result.return_values

    @property
    def hook_names(self) -> list[str]:
        return [c.name for c in self.calls]

    def calls_to(self, hook: str) -> list[HookCall]:
        return [c for c in self.calls if c.name == hook]


def _plugin_name(plugin: object) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__.rsplit(".", 1)[-1]
    cls = plugin if inspect.isclass(plugin) else type(plugin)
    return str(getattr(plugin, "name", None) or cls.__name__)


class AgentRunner:
    """Runs standalone agents whose log directories live under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: list[AgentRun] = []

    def host_with(self, plugins: Sequence[object]) -> PluginHost:
        """A plugin host with exactly ``plugins`` (see the module docstring)."""
        host = PluginHost(autoload=False)
        names = [p for p in plugins if isinstance(p, str)]
        if names:
            host.load(names)
            for name in names:
                record = next((r for r in host.records if r.name == name), None)
                if record is None or record.status != "ok":
                    why = record.error if record else "no such elastic.plugins entry point"
                    raise LookupError(f"hook plugin {name!r} did not load: {why}")
        for plugin in plugins:
            if isinstance(plugin, str):
                continue
            name, obj = plugin if isinstance(plugin, tuple) else (_plugin_name(plugin), plugin)
            host.register(obj() if inspect.isclass(obj) else obj, name)
        return host

    def run(
        self,
        entrypoint: str | Callable[..., Any],
        *args: Any,
        nproc: int = 1,
        plugins: Sequence[object] = (),
        options: Mapping[str, Any] | None = None,
        max_restarts: int = 0,
        monitor_interval: float = 0.05,
        shutdown_timeout: float = 2.0,
        env: Mapping[str, str] | None = None,
    ) -> AgentRun:
        """Run ``entrypoint`` (a function, a script path or a program) on ``nproc``
        workers to the end; ``options`` are plugin option values by dest."""
        from elastic.api import command_for

        host = self.host_with(plugins)
        calls: list[HookCall] = []
        running: list[HookCall] = []  # a stack: a hook may call another

        def before(hook: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            running.append(HookCall(hook, dict(kwargs), call_order(impls)))
            calls.append(running[-1])

        def after(outcome: Any, hook: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            call = running.pop()
            call.error = outcome.exception
            if outcome.exception is None:
                call.result = outcome.get_result()

        host.pm.add_hookcall_monitoring(before, after)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            standalone=True,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            shutdown_timeout=shutdown_timeout,
            log_dir=str(self.root / f"run{len(self.runs)}"),
            extra_env=dict(env or {}),
            plugin_options=dict(options or {}),
        )
        command, command_args = command_for(entrypoint, args)
        agent = create_agent(config, command, command_args, plugin_host=host)
        result = agent.run()
        run = AgentRun(result, calls, host, agent.get_worker_group().spec)
        started = run.calls_to("elastic_agent_start")
        if started:
            run.config = started[0].kwargs["config"]
        self.runs.append(run)
        return run
