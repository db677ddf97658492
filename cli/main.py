"""The ``elastic`` command. Importing it stays cheap: no torch, no plugin modules.

The command is the program, so it, not the library, configures logging: one
``StderrHandler`` on the ``elastic`` logger (``core/log.py``), and that logger's level
from ``LOGLEVEL`` (as torchrun reads it; torchrun has no ``--log-level`` flag). The root
logger is left alone.
"""

from __future__ import annotations

import logging
import os
import sys

import click
from elastic import __version__
from elastic.cli.plugins_cmd import plugins_group
from elastic.cli.run import run_command
from elastic.cli.status import status_command
from elastic.core.log import LOG, StderrHandler, say

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="elastic")
def cli() -> None:
    """elastic: a fault-tolerant, elastic launcher for PyTorch distributed training."""


cli.add_command(run_command)
cli.add_command(plugins_group)
cli.add_command(status_command)


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
