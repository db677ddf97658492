"""How a ``LaunchConfig`` flows: the one table of where each of its fields goes, and the
views of the launch built from it, in this module only: the workers' (``WorkerSpec``),
the rendezvous's (``RendezvousParameters``) and the agent's (``ElasticConfig``, what its
hook plugins are told, and its own keyword arguments).

A field flows by this table, never by a matching name, so a field added to or renamed in
``LaunchConfig`` or a view and not given its place here fails ``tests/test_launch_views.py``
instead of silently no longer reaching the code that reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from elastic.core.interfaces.rendezvous import RendezvousParameters
from elastic.core.interfaces.spec import WorkerSpec
from elastic.core.launch.config import LaunchConfig, per_local_rank
from elastic.core.plugin.config import ElasticConfig

if TYPE_CHECKING:
    from elastic.core.interfaces.rendezvous import RendezvousHandler

# The views, by the name the table uses for each.
VIEWS = {
    "spec": WorkerSpec,  # the workers'
    "rendezvous": RendezvousParameters,  # the rendezvous backend's
    "plugins": ElasticConfig,  # what the agent's hook plugins are told
}
AGENT = "agent"  # a keyword argument of LocalElasticAgent
LAUNCH = "launch"  # read before any view is built (the launcher, the Python API)

# Each LaunchConfig field -> where it goes: "view" (the view's field of the same name),
# "view:field" (another name there), or LAUNCH / AGENT.
FLOWS: dict[str, tuple[str, ...]] = {
    "min_nodes": ("rendezvous", "plugins"),
    "max_nodes": ("rendezvous", "plugins"),
    "nproc_per_node": ("spec:local_world_size", "plugins"),
    "run_id": ("rendezvous", "plugins"),  # plugins: the handler's, when it has one
    "role": ("spec", "plugins"),
    "rdzv_backend": ("rendezvous:backend", "plugins"),
    "rdzv_endpoint": ("rendezvous:endpoint", "plugins"),
    "rdzv_configs": ("rendezvous:config",),
    "standalone": (LAUNCH,),  # picks the standalone handler, no backend
    "max_restarts": ("spec", "plugins"),
    "monitor_interval": ("spec", "plugins"),
    "start_method": ("spec", "plugins"),
    "log_dir": ("spec", "plugins"),
    "redirects": ("spec",),  # spelled per local rank
    "tee": ("spec",),  # spelled per local rank
    "local_ranks_filter": ("spec",),
    "local_addr": ("spec", "rendezvous", "plugins"),
    "node_rank": ("rendezvous",),
    "signals_to_handle": (AGENT,),
    "shutdown_timeout": ("spec",),
    "extra_env": ("spec",),
    "fingerprint": ("rendezvous",),
    "allow_mismatch": ("rendezvous",),
    "virtual_local_rank": ("spec",),
    "numa_binding": ("spec",),
    "warm_restarts": ("spec",),
    "duplicate_stdout_filters": ("spec",),
    "duplicate_stderr_filters": ("spec",),
    # torch's field; the Python API turns it into the backend's --rdzv-conf key
    "rdzv_timeout": (LAUNCH,),
    "plugin_options": ("plugins",),  # checked and converted by the plugins' options
    "stall_timeout": ("spec",),
    "health_port": ("spec",),
    "preemption_signal": ("spec",),
    "preemption_grace": ("spec",),
    "quiet": (AGENT,),
    "event_log_handler": ("plugins",),
}

# A view's fields that do not come from the launch configuration, and who sets them.
NOT_FROM_THE_LAUNCH: dict[str, frozenset[str]] = {
    # the launch's command, the handler built for it, and the round's master (rendezvous)
    "spec": frozenset({"entrypoint", "args", "rdzv_handler", "master_addr", "master_port"}),
    "rendezvous": frozenset({"read_only"}),  # elastic status's handlers only
    "plugins": frozenset(),
}


def flows_into(view: str) -> dict[str, str]:
    """LaunchConfig field -> the field of `view` it fills, as ``FLOWS`` says."""
    into = {}
    for name, targets in FLOWS.items():
        for target in targets:
            target_view, _, target_field = target.partition(":")
            if target_view == view:
                into[name] = target_field or name
    return into


def values_for(
    config: LaunchConfig, view: str, convert: Mapping[str, Callable[[Any], Any]]
) -> dict[str, Any]:
    """The values `view` takes from `config`, by the view's field names; `convert` changes
    some of them on the way (by LaunchConfig field name)."""
    return {
        target: convert.get(name, lambda value: value)(getattr(config, name))
        for name, target in flows_into(view).items()
    }


def rendezvous_parameters(config: LaunchConfig) -> RendezvousParameters:
    """What the rendezvous backend is told about this launch."""
    return RendezvousParameters(
        **values_for(config, "rendezvous", {"rdzv_configs": dict, "fingerprint": dict})
    )


def worker_spec(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[str, ...],
    handler: RendezvousHandler | None,
) -> WorkerSpec:
    """This node's worker spec, with ``--redirects``/``--tee`` spelled per local rank and
    an environment of its own."""
    nproc = config.nproc_per_node
    values = values_for(
        config,
        "spec",
        {
            "redirects": lambda value: per_local_rank(value, nproc),
            "tee": lambda value: per_local_rank(value, nproc),
            "extra_env": dict,
        },
    )
    return WorkerSpec(**values, entrypoint=entrypoint, args=args, rdzv_handler=handler)


def plugin_config(
    config: LaunchConfig, plugin_options: Mapping[str, Any], run_id: str
) -> ElasticConfig:
    """What hook plugins are told about this launch: the run id is the rendezvous
    handler's when it has one (a backend may fill in the job id itself), the plugin
    options their checked values."""
    values = values_for(config, "plugins", {})
    return ElasticConfig(
        **{**values, "run_id": run_id or config.run_id, "plugin_options": plugin_options}
    )


def agent_arguments(config: LaunchConfig) -> dict[str, Any]:
    """``LocalElasticAgent``'s keyword arguments that come from the launch."""
    return {name: getattr(config, name) for name, targets in FLOWS.items() if AGENT in targets}
