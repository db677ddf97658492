"""The ``elastic`` command. Importing it stays cheap: no torch, no plugin modules, and
of the commands only ``run``: ``plugins`` and ``status`` are imported when they are asked
for (or listed, by ``elastic --help``), so an agent's start does not pay for them.

The command is the program, so it, not the library, configures logging: one
``StderrHandler`` on the ``elastic`` logger (``core/log.py``), and that logger's level
from ``LOGLEVEL`` (as torchrun reads it; torchrun has no ``--log-level`` flag). The root
logger is left alone.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click
from elastic import __version__
from elastic.cli.run import run_command
from elastic.core.log import LOG, StderrHandler, say

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# command name -> "module:attribute" of a command imported only when it is used
LAZY_COMMANDS = {
    "plugins": "elastic.cli.plugins_cmd:plugins_group",
    "status": "elastic.cli.status:status_command",
}


class Commands(click.Group):
    """``run`` is registered; the commands of ``LAZY_COMMANDS`` are imported on first use
    (click's documented lazy loading: ``list_commands`` and ``get_command``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = LAZY_COMMANDS.get(cmd_name)
        if target is not None and cmd_name not in self.commands:
            module, attr = target.split(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="elastic")
def cli() -> None:
    """elastic: a fault-tolerant, elastic launcher for PyTorch distributed training."""


cli.add_command(run_command)


def configure_logging() -> None:
    """Show the ``elastic`` logger on stderr at ``LOGLEVEL`` (default WARNING; lines are
    shown at any level); a level logging does not know is one line and exit status 2."""
    name = os.environ.get("LOGLEVEL", "WARNING").strip().upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        say(
            f"elastic: error: LOGLEVEL={os.environ['LOGLEVEL']!r} is not a log level; "
            f"expected one of {', '.join(LEVELS)}",
            logging.ERROR,
        )
        sys.exit(2)
    if not any(isinstance(h, StderrHandler) and h.name == "elastic-cli" for h in LOG.handlers):
        handler = StderrHandler()
        handler.name = "elastic-cli"
        LOG.addHandler(handler)
    LOG.setLevel(level)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; a user mistake is one line on stderr and exit status 2."""
    configure_logging()
    try:
        cli.main(args=argv, prog_name="elastic", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        command = (
            f"elastic {exc.ctx.info_name}"
            if getattr(exc, "ctx", None) and exc.ctx.info_name != "elastic"
            else "elastic"
        )
        say(f"{command}: error: {exc.format_message()}", logging.ERROR)
        sys.exit(exc.exit_code)
    except click.Abort:
        say("elastic: aborted", logging.ERROR)
        sys.exit(130)
    sys.exit(0)
