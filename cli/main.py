"""The ``elastic`` command. Importing it stays cheap: no torch, no plugin modules."""

from __future__ import annotations

import logging
import os
import sys

import click
from elastic import __version__
from elastic.cli.plugins_cmd import plugins_group
from elastic.cli.run import run_command
from elastic.cli.status import status_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="elastic")
def cli() -> None:
    """elastic: a fault-tolerant, elastic launcher for PyTorch distributed training."""


cli.add_command(run_command)
cli.add_command(plugins_group)
cli.add_command(status_command)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; a user mistake is one line on stderr and exit status 2."""
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "WARNING").upper(),
        format="[elastic] %(levelname)s: %(message)s",
    )
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
        click.echo(f"{command}: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("elastic: aborted", err=True)
        sys.exit(130)
    sys.exit(0)
