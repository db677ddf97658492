"""``elastic run``: torchrun's flags, validated up front, then one agent for this node."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from typing import TYPE_CHECKING, Any

import click
from elastic.cli.options import (
    flag,
    parse_endpoint,
    parse_local_ranks_filter,
    parse_nnodes,
    parse_nproc_per_node,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
)
from elastic.cli.plugin_options import RunCommand, plugin_host, plugin_values
from elastic.core.launch.launcher import LaunchConfig, python_exec, run_script_path
from elastic.core.rendezvous.fingerprint import node_fingerprint, parse_allowed
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


def bad(option: str, message: str) -> click.BadParameter:
    return click.BadParameter(message, param_hint=f"'{option}'")


def std_map(value: str, option: str, nproc: int) -> dict[int, int]:
    try:
        parsed = parse_std(value, option)
    except click.BadParameter as exc:
        raise bad(option, exc.message) from None
    return {rank: parsed for rank in range(nproc)} if isinstance(parsed, int) else parsed


def split_filters(value: str) -> tuple[str, ...]:
    return tuple(f for f in value.split(",") if f)


def resolve_rendezvous(
    opts: dict[str, Any], min_nodes: int, max_nodes: int
) -> tuple[bool, str, str, dict[str, str]]:
    """(standalone, backend, endpoint, rdzv_conf) as torchrun would pick them."""
    try:
        conf = parse_rdzv_conf(opts["rdzv_conf"])
    except click.BadParameter as exc:
        raise bad("--rdzv-conf", exc.message) from None
    backend, endpoint = opts["rdzv_backend"], opts["rdzv_endpoint"]
    if opts["standalone"]:
        if max_nodes != 1:
            raise bad("--standalone", f"runs one node, but --nnodes={opts['nnodes']}")
        return True, "standalone", "", conf
    if backend == "static":
        if not endpoint and opts["master_port"] is None and max_nodes == 1:
            # torchrun switches a lone node with nothing configured to a local rendezvous.
            return True, "standalone", "", conf
        if not endpoint:
            port = 29500 if opts["master_port"] is None else opts["master_port"]
            endpoint = f"{opts['master_addr']}:{port}"
    if endpoint:
        try:
            parse_endpoint(endpoint, None)
        except click.BadParameter as exc:
            raise bad("--rdzv-endpoint", exc.message) from None
    return False, backend, endpoint, conf


def entrypoint_for(opts: dict[str, Any]) -> tuple[Any, tuple[str, ...]]:
    script, script_args = opts["training_script"], tuple(opts["training_script_args"])
    if opts["no_python"] and opts["module"]:
        raise click.UsageError("--no-python and -m/--module cannot be used together")
    if opts["run_path"]:
        return run_script_path, (script, *script_args)
    if opts["no_python"]:
        if not (shutil.which(script) or os.access(script, os.X_OK)):
            raise bad("training_script", f"{script!r} is not an executable program (--no-python)")
        return script, script_args
    if opts["module"]:
        return python_exec(), ("-u", "-m", script, *script_args)
    return python_exec(), ("-u", script, *script_args)


def check_script(opts: dict[str, Any]) -> None:
    script = opts["training_script"]
    if script.startswith("-"):
        raise click.UsageError(f"no such option: {script} (see elastic run --help)")
    if opts["module"] or opts["no_python"]:
        return
    if not os.path.isfile(script):
        raise bad("training_script", f"{script!r} does not exist; give the path of a Python script")


def build_config(
    opts: dict[str, Any], plugin_options: dict[str, Any] | None = None
) -> tuple[LaunchConfig, Any, tuple[str, ...], HandlerFactory | None]:
    """The launch, its entrypoint and arguments, and the backend's factory (resolved once
    here, so a bad name fails before anything starts, and reused by the launcher)."""
    try:
        min_nodes, max_nodes = parse_nnodes(opts["nnodes"])
    except click.BadParameter as exc:
        raise bad("--nnodes", exc.message) from None
    try:
        nproc = parse_nproc_per_node(opts["nproc_per_node"])
    except click.BadParameter as exc:
        raise bad("--nproc-per-node", exc.message) from None
    if opts["max_restarts"] < 0:
        raise bad("--max-restarts", f"{opts['max_restarts']} is negative; expected 0 or more")
    if opts["monitor_interval"] <= 0:
        raise bad("--monitor-interval", "expected a positive number of seconds")
    if opts["stall_timeout"] is not None and not opts["stall_timeout"] > 0:
        raise bad("--stall-timeout", "expected a positive number of seconds")
    if opts["health_port"] is not None and not 1 <= opts["health_port"] <= 65535:
        raise bad("--health-port", f"{opts['health_port']} is not a port; expected 1..65535")
    if not opts["preemption_grace"] >= 0:
        raise bad("--preemption-grace", "expected a number of seconds >= 0 (0: leave at once)")
    preemption_signal = opts["preemption_signal"].strip().upper()
    if not preemption_signal.startswith("SIG"):
        preemption_signal = "SIG" + preemption_signal
    if not hasattr(signal, preemption_signal):
        raise bad("--preemption-signal", f"{opts['preemption_signal']!r} is not a signal name")
    standalone, backend, endpoint, conf = resolve_rendezvous(opts, min_nodes, max_nodes)
    factory = None
    if not standalone:
        from elastic.core.rendezvous.registry import BackendNotFoundError, get_backend_factory

        try:
            factory = get_backend_factory(backend)
        except BackendNotFoundError as exc:
            raise bad("--rdzv-backend", str(exc)) from None
    check_script(opts)
    entrypoint, args = entrypoint_for(opts)
    try:
        ranks_filter = parse_local_ranks_filter(opts["local_ranks_filter"])
        signals = parse_signals(opts["signals_to_handle"])
    except click.BadParameter as exc:
        raise bad("--local-ranks-filter/--signals-to-handle", exc.message) from None
    if preemption_signal not in signals:  # the notice must reach the agent, not kill it
        signals = (*signals, preemption_signal)

    try:
        allow_mismatch = parse_allowed(conf.pop("allow_mismatch", None))
    except ValueError as exc:
        raise bad("--rdzv-conf", str(exc)) from None
    script = opts["training_script"]
    fingerprint = node_fingerprint(
        nproc_per_node=nproc,
        entrypoint=("-m " if opts["module"] else "") + script,
        script=None if opts["module"] or opts["no_python"] else script,
        max_restarts=opts["max_restarts"],
    )

    if opts["logs_specs"] not in (None, "", "default"):
        raise bad("--logs-specs", f"{opts['logs_specs']!r}: only the default log layout exists")
    if opts["numa_binding"]:
        raise bad("--numa-binding", "NUMA binding is not provided; run under numactl instead")

    extra_env: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        log.warning(OMP_WARNING)
        extra_env["OMP_NUM_THREADS"] = "1"
    shutdown_timeout = opts["shutdown_timeout"]
    if shutdown_timeout is None:
        shutdown_timeout = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))

    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=opts["rdzv_id"],
        role=opts["role"],
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=conf,
        standalone=standalone,
        max_restarts=opts["max_restarts"],
        monitor_interval=opts["monitor_interval"],
        start_method=opts["start_method"],
        log_dir=opts["log_dir"],
        redirects=std_map(opts["redirects"], "--redirects", nproc),
        tee=std_map(opts["tee"], "--tee", nproc),
        local_ranks_filter=ranks_filter,
        local_addr=opts["local_addr"],
        node_rank=opts["node_rank"] if backend == "static" or opts["node_rank"] else None,
        signals_to_handle=signals,
        shutdown_timeout=shutdown_timeout,
        extra_env=extra_env,
        fingerprint=fingerprint,
        allow_mismatch=allow_mismatch,
        virtual_local_rank=opts["virtual_local_rank"],
        duplicate_stdout_filters=split_filters(opts["duplicate_stdout_filters"]),
        duplicate_stderr_filters=split_filters(opts["duplicate_stderr_filters"]),
        plugin_options=dict(plugin_options or {}),
        stall_timeout=opts["stall_timeout"],
        health_port=opts["health_port"],
        preemption_signal=preemption_signal,
        preemption_grace=opts["preemption_grace"],
        quiet=opts["quiet"],
    )
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
    help="Workers per node: N, auto, cpu or gpu.",
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
@flag("--numa-binding", default=None, help="Not provided; rejected with an error.")
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
@click.argument("training_script")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, **opts: Any) -> None:
    """Run TRAINING_SCRIPT on this node with torchrun's semantics.

    Start the same command on every node; the agents rendezvous, each gets a node rank and
    starts --nproc-per-node workers with torchrun's environment (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, ...). Installed plugins add their own options (listed below
    under each plugin's name).
    """
    config, entrypoint, args, factory = build_config(opts, plugin_values(ctx, opts))
    from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousError
    from elastic.core.launch.launcher import launch
    from elastic.core.watchdog.health import HealthPortError

    try:
        result = launch(
            config, entrypoint, args, plugin_host=plugin_host(ctx), handler_factory=factory
        )
    except (RendezvousConfigError, HealthPortError) as exc:
        raise click.UsageError(str(exc)) from None
    except RendezvousError as exc:
        click.echo(f"elastic run: error: {exc}", err=True)
        sys.exit(1)
    if result.message and result.exit_code != 0:
        log.debug("run failed: %s", result.message)
    sys.exit(result.exit_code)
