"""From a launch configuration to an agent ready to run: pick the rendezvous, build the agent
from the launch's views (``views``). What ``elastic run`` and ``elastic_launch`` both run."""

from __future__ import annotations

import logging
import os
import resource
import sys
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic.core.interfaces.rendezvous import RendezvousHandler
from elastic.core.launch import views
from elastic.core.launch.config import LaunchConfig

if TYPE_CHECKING:
    from elastic.core.agent.loop import LocalElasticAgent
    from elastic.core.plugin.host import PluginHost
    from elastic.core.rendezvous.registry import HandlerFactory

log = logging.getLogger(__name__)


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; the soft limit now.

    The agent that hosts a store holds a socket per connection: a 1,000-node c10d job's
    host holds more than 1,000, and the static backend's host also every worker's, while
    a common default soft limit is 1,024. The hard limit is what the administrator
    allows, so raising to it needs no privilege. Workers inherit the raised limit (data
    loaders that open many files are glad of it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # an unlimited hard limit Linux will not grant
        log.debug("could not raise the open files limit from %s to %s: %s", soft, hard, exc)
        return soft
    return hard


def run_script_path(script: str, *args: str) -> None:
    """``--run-path``: run a script in the worker's interpreter as ``__main__``."""
    import runpy  # in the worker only

    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def create_handler(
    config: LaunchConfig, factory: HandlerFactory | None = None
) -> RendezvousHandler:
    """The rendezvous for this launch; a single node without a server needs no plugin.

    ``factory`` is the backend the caller already resolved (``elastic run`` checks the
    name before anything starts), so a launch looks its backend up once."""
    if config.standalone:
        from elastic.core.rendezvous.local import LocalRendezvousHandler

        return LocalRendezvousHandler(run_id=config.run_id, local_addr=config.local_addr)
    if factory is None:
        from elastic.core.rendezvous.registry import get_backend_factory

        factory = get_backend_factory(config.rdzv_backend)
    return factory(views.rendezvous_parameters(config))


def plugin_option_values(host: PluginHost, given: dict[str, Any]) -> dict[str, Any]:
    """Every plugin option's value: ``given`` (checked and converted) over the defaults.

    A name no installed plugin declares is a ValueError listing the known ones."""
    options = {o.dest: o for o in host.options()}
    unknown = sorted(set(given) - set(options))
    if unknown:
        known = ", ".join(sorted(options)) or "none"
        raise ValueError(f"unknown plugin option(s) {', '.join(unknown)}; known: {known}")
    values = {dest: option.default for dest, option in options.items()}
    for dest, value in given.items():
        try:
            values[dest] = options[dest].parse(value)
        except ValueError as exc:
            raise ValueError(f"plugin option {dest}: {exc}") from None
    return values


def create_agent(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    plugin_host: PluginHost | None = None,
    handler_factory: HandlerFactory | None = None,
) -> LocalElasticAgent:
    """The agent for this node: its rendezvous, worker spec, plugins and their config.

    ``plugin_host`` defaults to one with the installed hook plugins."""
    from elastic.core.agent.loop import LocalElasticAgent
    from elastic.core.plugin.host import PluginHost

    config.validate()  # a config may have changed since it was made
    raise_open_files_limit()  # before a store is hosted: its connections need descriptors
    host = plugin_host if plugin_host is not None else PluginHost()
    options = plugin_option_values(host, config.plugin_options)
    if config.standalone and config.run_id == "none":
        config.run_id = str(uuid.uuid4())
    handler = create_handler(config, handler_factory)
    return LocalElasticAgent(
        views.worker_spec(config, entrypoint, args, handler),
        plugin_host=host,
        config=views.plugin_config(config, options, handler.get_run_id()),
        **views.agent_arguments(config),
    )


def python_exec() -> str:
    """The interpreter for workers: ``PYTHON_EXEC`` overrides, as in torchrun."""
    return os.environ.get("PYTHON_EXEC", sys.executable)
