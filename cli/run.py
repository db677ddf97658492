"""``elastic run``: torchrun's flags, validated up front, then one agent for this node.

Owns the command and its flags; how their values become the launch is ``run_config``'s.
May import the CLI's ``options``, ``plugin_options``, ``slurm``, ``dry_run`` and
``run_config``; outside the CLI, ``core.launch``, ``core.log``, ``core.workers`` and,
for the errors a launch ends with, ``core.interfaces``, ``core.plugin`` and
``core.watchdog``.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Any

import click
from elastic.cli.options import bad, flag
from elastic.cli.plugin_options import RunCommand, note_event_log, plugin_host, plugin_values
from elastic.cli.run_config import build_config
from elastic.core.log import say
from elastic.core.workers import numa
from elastic.core.workers.signals import DEFAULT_SIGNALS

log = logging.getLogger("elastic")


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
@flag(
    "--warm-restarts",
    is_flag=True,
    help="Keep a started interpreter per local rank (with torch imported when the workers "
    "import it), so a restart's workers start at once; costs one idle process per worker.",
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
    slurm = None
    if any(name.startswith("SLURM_") for name in os.environ):  # its module only in SLURM
        from elastic.cli.slurm import fill_from_slurm

        slurm = fill_from_slurm(ctx, opts, os.environ)
    config, entrypoint, args, factory = build_config(opts, plugin_values(ctx, opts))
    if dry_run:
        from elastic.cli.dry_run import plan_lines

        click.echo("\n".join(plan_lines(config, entrypoint, args, slurm[1] if slurm else {})))
        sys.exit(0)
    if slurm and not config.quiet:
        from elastic.cli.slurm import took_line

        say(took_line(*slurm))
    note_event_log(ctx, config.event_log_handler)
    from elastic.core.interfaces.rendezvous import RendezvousConfigError, RendezvousError
    from elastic.core.launch.launcher import create_agent
    from elastic.core.plugin.extras import MissingExtraError
    from elastic.core.watchdog.health import HealthPortError

    try:
        agent = create_agent(
            config, entrypoint, args, plugin_host=plugin_host(ctx), handler_factory=factory
        )
        # Everything this process imports (the plugins too) is loaded by now and lives
        # until it exits: frozen, the collector never walks it again, neither while the
        # agent runs nor in the final collection at exit (about 20 ms of an agent's CPU).
        # Only in this command's own process: elastic_launch() runs in a user's.
        gc.freeze()
        result = agent.run()
    except (RendezvousConfigError, HealthPortError, MissingExtraError) as exc:
        raise click.UsageError(str(exc)) from None
    except RendezvousError as exc:
        say(f"elastic run: error: {exc}", logging.ERROR)
        sys.exit(1)
    if result.message and result.exit_code != 0:
        log.debug("run failed: %s", result.message)
    sys.exit(result.exit_code)
