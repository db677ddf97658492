"""``elastic run``: torchrun's flags, validated up front, then one agent for this node."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import click
from elastic.cli.entrypoint import check_script, entrypoint_for, fingerprint_for
from elastic.cli.options import (
    bad,
    flag,
    parse_endpoint,
    parse_local_ranks_filter,
    parse_nnodes,
    parse_nproc_per_node,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
)
from elastic.cli.plugin_options import RunCommand, note_event_log, plugin_host, plugin_values
from elastic.cli.slurm import fill_from_slurm, took_line
from elastic.core.launch.config import LaunchConfig, SettingError
from elastic.core.log import say
from elastic.core.rendezvous.fingerprint import parse_allowed
from elastic.core.workers import numa
from elastic.core.workers.process import DEFAULT_SIGNALS

if TYPE_CHECKING:
    from elastic.core.rendezvous.registry import HandlerFactory

log = logging.getLogger("elastic")

OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
    "to avoid your system being overloaded, please further tune the variable for optimal "
    "performance in your application as needed. \n"
    "*****************************************"
)


def option_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def split_filters(value: str) -> tuple[str, ...]:
    return tuple(f for f in value.split(",") if f)


def shutdown_timeout(value: float | None) -> float:
    """torch's default: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30 seconds."""
    return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")) if value is None else value


class To(NamedTuple):
    """Where an option's value goes: these ``LaunchConfig`` fields, as ``parse`` makes it
    (None: as click gives it; a parser for several fields returns one value for each)."""

    fields: tuple[str, ...]
    parse: Callable[[Any], Any] | None = None


def to(*fields: str, parse: Callable[[Any], Any] | None = None) -> To:
    return To(fields, parse)


# The options that map one to one onto the launch, by click's dest. Those whose values
# decide together are resolved below: the rendezvous (RENDEZVOUS_OPTIONS), the entrypoint
# and its fingerprint (ENTRYPOINT_OPTIONS), and the two torchrun options we reject.
OPTIONS: dict[str, To] = {
    "nnodes": to("min_nodes", "max_nodes", parse=parse_nnodes),
    "nproc_per_node": to("nproc_per_node", parse=parse_nproc_per_node),
    "rdzv_id": to("run_id"),
    "role": to("role"),
    "max_restarts": to("max_restarts"),
    "monitor_interval": to("monitor_interval"),
    "start_method": to("start_method"),
    "log_dir": to("log_dir"),
    "redirects": to("redirects", parse=lambda value: parse_std(value, "--redirects")),
    "tee": to("tee", parse=lambda value: parse_std(value, "--tee")),
    "local_ranks_filter": to("local_ranks_filter", parse=parse_local_ranks_filter),
    "local_addr": to("local_addr"),
    "signals_to_handle": to("signals_to_handle", parse=parse_signals),
    "shutdown_timeout": to("shutdown_timeout", parse=shutdown_timeout),
    "virtual_local_rank": to("virtual_local_rank"),
    "duplicate_stdout_filters": to("duplicate_stdout_filters", parse=split_filters),
    "duplicate_stderr_filters": to("duplicate_stderr_filters", parse=split_filters),
    "stall_timeout": to("stall_timeout"),
    "health_port": to("health_port"),
    "preemption_signal": to("preemption_signal"),
    "preemption_grace": to("preemption_grace"),
    "quiet": to("quiet"),
    "event_log_handler": to("event_log_handler"),
    "numa_binding": to("numa_binding"),
}
RENDEZVOUS_OPTIONS = (
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "standalone",
    "master_addr",
    "master_port",
    "node_rank",
)
ENTRYPOINT_OPTIONS = ("module", "no_python", "run_path", "training_script", "training_script_args")
REJECTED_OPTIONS = ("logs_specs", "log_line_prefix_template")
COMMAND_OPTIONS = ("dry_run", "print_completion")  # about the command itself, not the launch


def mapped_fields(opts: dict[str, Any]) -> dict[str, Any]:
    """The ``OPTIONS`` part of the launch, each value parsed under its option's name."""
    values: dict[str, Any] = {}
    for dest, target in OPTIONS.items():
        value = opts[dest]
        if target.parse is not None:
            try:
                value = target.parse(value)
            except click.BadParameter as exc:
                raise bad(option_name(dest), exc.message) from None
        values.update(
            zip(target.fields, value if len(target.fields) > 1 else (value,), strict=True)
        )
    return values


def option_for(field: str) -> str:
    """The option that sets a ``LaunchConfig`` field, to name it in an error."""
    dest = next((d for d, target in OPTIONS.items() if field in target.fields), field)
    return option_name(dest)


def resolve_rendezvous(opts: dict[str, Any], max_nodes: int) -> dict[str, Any]:
    """The rendezvous fields as torchrun would pick them: standalone, the backend and
    endpoint, its settings, the fingerprint fields it may ignore and the node rank."""
    try:
        conf = parse_rdzv_conf(opts["rdzv_conf"])
    except click.BadParameter as exc:
        raise bad("--rdzv-conf", exc.message) from None
    try:
        allow_mismatch = parse_allowed(conf.pop("allow_mismatch", None))
    except ValueError as exc:
        raise bad("--rdzv-conf", str(exc)) from None
    backend, endpoint, standalone = opts["rdzv_backend"], opts["rdzv_endpoint"], False
    if opts["standalone"]:
        if max_nodes != 1:
            raise bad("--standalone", f"runs one node, but --nnodes={opts['nnodes']}")
        standalone = True
    elif backend == "static":
        if not endpoint and opts["master_port"] is None and max_nodes == 1:
            # torchrun switches a lone node with nothing configured to a local rendezvous.
            standalone = True
        elif not endpoint:
            port = 29500 if opts["master_port"] is None else opts["master_port"]
            endpoint = f"{opts['master_addr']}:{port}"
    if endpoint and not standalone:  # a standalone launch has none (LaunchConfig)
        try:  # several, comma-separated: etcd's members, c10d's candidate store hosts
            for one in endpoint.split(","):
                parse_endpoint(one.strip(), None)
        except click.BadParameter as exc:
            raise bad("--rdzv-endpoint", exc.message) from None
    static_rank = backend == "static" and not standalone  # the rank static needs
    return {
        "standalone": standalone,
        "rdzv_backend": backend,
        "rdzv_endpoint": endpoint,
        "rdzv_configs": conf,
        "allow_mismatch": allow_mismatch,
        "node_rank": opts["node_rank"] if static_rank or opts["node_rank"] else None,
    }


def check_rejected(opts: dict[str, Any]) -> None:
    if opts["logs_specs"] not in (None, "", "default"):
        raise bad("--logs-specs", f"{opts['logs_specs']!r}: only the default log layout exists")
    if opts["log_line_prefix_template"]:
        raise bad("--log-line-prefix-template", "a template for worker lines is not provided")


def check_numa_binding(mode: str | None, nproc: int) -> None:
    """Compute the binding now, so what this node lacks for it is one line before any
    worker starts (the agent binds each worker as it starts it)."""
    if mode:
        try:
            numa.plan(mode, nproc)
        except numa.NumaBindingError as exc:
            raise bad("--numa-binding", f"{mode}: {exc}") from None


def print_completion(ctx: click.Context, _param: click.Parameter, shell: str | None) -> None:
    """torchrun 2.14's ``--print-completion SHELL``: the shell's completion script for
    ``elastic`` (click's, which completes its commands and options), then exit."""
    if shell is None or ctx.resilient_parsing:
        return
    from click.shell_completion import get_completion_class

    completion = get_completion_class(shell)
    if completion is None:
        raise bad("--print-completion", f"{shell!r}: completion is provided for bash and zsh")
    root = ctx.find_root()
    prog = root.info_name or "elastic"
    var = f"_{prog.upper().replace('-', '_')}_COMPLETE"
    click.echo(completion(root.command, {}, prog, var).source())
    ctx.exit(0)


def build_config(
    opts: dict[str, Any], plugin_options: dict[str, Any] | None = None
) -> tuple[LaunchConfig, Any, tuple[str, ...], HandlerFactory | None]:
    """The launch, its entrypoint and arguments, and the backend's factory (resolved once
    here, so a bad name fails before anything starts, and reused by the launcher)."""
    fields = mapped_fields(opts)
    fields.update(resolve_rendezvous(opts, fields["max_nodes"]))
    check_script(opts)
    entrypoint, args = entrypoint_for(opts)
    check_rejected(opts)
    check_numa_binding(fields["numa_binding"], fields["nproc_per_node"])
    fields["fingerprint"] = fingerprint_for(opts, fields["nproc_per_node"], fields["max_restarts"])
    omp = "OMP_NUM_THREADS" not in os.environ and fields["nproc_per_node"] > 1
    fields["extra_env"] = {"OMP_NUM_THREADS": "1"} if omp else {}
    try:
        config = LaunchConfig(**fields, plugin_options=dict(plugin_options or {}))
    except SettingError as exc:
        raise bad(option_for(exc.field), exc.reason) from None
    if config.preemption_signal not in config.signals_to_handle:
        # the notice must reach the agent, not kill it
        config.signals_to_handle = (*config.signals_to_handle, config.preemption_signal)
    factory = None
    if not config.standalone:
        from elastic.core.rendezvous.registry import BackendNotFoundError, get_backend_factory

        try:
            factory = get_backend_factory(config.rdzv_backend)
        except BackendNotFoundError as exc:
            raise bad("--rdzv-backend", str(exc)) from None
    if omp:
        log.warning(OMP_WARNING)
    return config, entrypoint, args, factory


@click.command(
    "run",
    cls=RunCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Start this node's agent and its workers (torchrun's flags).",
)
@flag("--nnodes", default="1:1", show_default=True, help="Number of nodes, N or MIN:MAX.")
@flag(
    "--nproc-per-node",
    default="1",
    show_default=True,
    help="Workers per node: N, auto, cpu, gpu or xpu.",
)
@flag("--rdzv-backend", default="static", show_default=True, help="Rendezvous backend name.")
@flag("--rdzv-endpoint", default="", help="Rendezvous endpoint, HOST[:PORT].")
@flag("--rdzv-id", default="none", show_default=True, help="Job id shared by every node.")
@flag("--rdzv-conf", default="", help="Backend settings, KEY=VALUE[,KEY=VALUE...].")
@flag("--standalone", is_flag=True, help="One node, local rendezvous, no server.")
@flag("--max-restarts", type=int, default=0, show_default=True, help="Job-wide restart budget.")
@flag(
    "--monitor-interval",
    type=float,
    default=0.1,
    show_default=True,
    help="Seconds between worker checks.",
)
@flag(
    "--start-method",
    type=click.Choice(["spawn", "fork", "forkserver"]),
    default="spawn",
    show_default=True,
)
@flag(
    "--event-log-handler",
    type=click.Choice(["null", "console"]),
    default="null",
    show_default=True,
    envvar=["PET_EVENT_LOG_HANDLER", "ELASTIC_EVENT_LOG_HANDLER"],
    help="Agent events as JSON lines on stderr: console (the event_log plugin), or null.",
)
@flag("--role", default="default", show_default=True, help="Worker role name.")
@flag("-m", "--module", is_flag=True, help="Run the script as a module (python -m).")
@flag("--no-python", is_flag=True, help="Run the script as a program, not with Python.")
@flag("--run-path", is_flag=True, help="Run the script with runpy.run_path in the worker.")
@flag("--log-dir", default=None, help="Directory for worker logs and error files.")
@flag(
    "-r",
    "--redirects",
    default="0",
    show_default=True,
    help="Redirect worker output to files: 0-3 or 0:3,1:2.",
)
@flag("-t", "--tee", default="0", show_default=True, help="Tee worker output to files and console.")
@flag("--local-ranks-filter", default="", help="Only show these local ranks' output, e.g. 0,1.")
@flag(
    "--node-rank", type=int, default=0, show_default=True, help="This node's rank (static backend)."
)
@flag(
    "--master-addr", default="127.0.0.1", show_default=True, help="Master address (static backend)."
)
@flag("--master-port", type=int, default=None, help="Master port (static backend; default 29500).")
@flag("--local-addr", default=None, help="This node's address as other nodes reach it.")
@flag("--signals-to-handle", default=",".join(DEFAULT_SIGNALS), show_default=True)
@flag(
    "--shutdown-timeout",
    type=float,
    default=None,
    help="Grace seconds between SIGTERM and SIGKILL.",
)
@flag("--virtual-local-rank", is_flag=True, help="LOCAL_RANK=0 and one visible GPU per worker.")
@flag(
    "--duplicate-stdout-filters",
    default="",
    help="Copy matching stdout lines to a file.",
)
@flag(
    "--duplicate-stderr-filters",
    default="",
    help="Copy matching stderr lines to a file.",
)
@flag("--logs-specs", default=None, help="Only the default log layout is provided.")
@flag(
    "--numa-binding",
    type=click.Choice(numa.MODES),
    default=None,
    help="Bind each worker to the CPUs near its GPU (node, socket, exclusive, core-complex).",
)
@flag("--log-line-prefix-template", default="", help="Not provided; rejected with an error.")
@flag(
    "--print-completion",
    type=click.Choice(["bash", "zsh", "tcsh"]),
    default=None,
    envvar=None,
    is_eager=True,
    expose_value=False,
    callback=print_completion,
    help="Print the shell's completion script for elastic and exit (bash, zsh).",
)
@flag(
    "--stall-timeout",
    type=float,
    default=None,
    help="Restart the job when a worker makes no progress for SECONDS (default: off).",
)
@flag(
    "--health-port",
    type=int,
    default=None,
    envvar=["PET_HEALTH_PORT", "TORCHELASTIC_HEALTH_CHECK_PORT"],
    help="Serve /healthz, /readyz and /metrics over HTTP on this port.",
)
@flag(
    "--preemption-signal",
    default="SIGTERM",
    show_default=True,
    help="The preemption notice: on it the whole job checkpoints, then this node leaves.",
)
@flag(
    "--preemption-grace",
    type=float,
    default=25.0,
    show_default=True,
    help="Seconds the job may take to checkpoint on a preemption notice (0: leave at once).",
)
@flag(
    "--quiet",
    is_flag=True,
    envvar=["PET_QUIET", "ELASTIC_QUIET"],
    help="No progress lines (who the rendezvous waits for, who came and left).",
)
@flag("--dry-run", is_flag=True, help="Print the launch (and what SLURM gave), start nothing.")
@click.argument("training_script")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, **opts: Any) -> None:
    """Run TRAINING_SCRIPT on this node with torchrun's semantics.

    Start the same command on every node; the agents rendezvous, each gets a node rank and
    starts --nproc-per-node workers with torchrun's environment (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, ...). Installed plugins add their own options (listed below
    under each plugin's name). Under srun, SLURM's task environment fills the node count,
    node rank and rendezvous flags not given (README, "Under SLURM").
    """
    dry_run = opts.pop("dry_run")
    slurm = fill_from_slurm(ctx, opts, os.environ)
    config, entrypoint, args, factory = build_config(opts, plugin_values(ctx, opts))
    if dry_run:
        from elastic.cli.dry_run import plan_lines

        click.echo("\n".join(plan_lines(config, entrypoint, args, slurm[1] if slurm else {})))
        sys.exit(0)
    if slurm and not config.quiet:
        say(took_line(*slurm))
    note_event_log(ctx, config.event_log_handler)
    from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousError
    from elastic.core.launch.launcher import launch
    from elastic.core.plugin.extras import MissingExtraError
    from elastic.core.watchdog.health import HealthPortError

    try:
        result = launch(
            config, entrypoint, args, plugin_host=plugin_host(ctx), handler_factory=factory
        )
    except (RendezvousConfigError, HealthPortError, MissingExtraError) as exc:
        raise click.UsageError(str(exc)) from None
    except RendezvousError as exc:
        say(f"elastic run: error: {exc}", logging.ERROR)
        sys.exit(1)
    if result.message and result.exit_code != 0:
        log.debug("run failed: %s", result.message)
    sys.exit(result.exit_code)
