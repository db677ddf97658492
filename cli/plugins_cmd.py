"""``elastic plugins list``: what is installed in the ``elastic.*`` groups and whether it loads."""

from __future__ import annotations

import json
from dataclasses import asdict

import click
from elastic.core import plugins


def load_records(load: bool) -> list[plugins.PluginRecord]:
    """Every entry point; with ``load``, each imported once to report its status."""
    host = plugins.plugin_host()
    records: list[plugins.PluginRecord] = []
    for group in plugins.GROUPS:
        if group == plugins.HOOK_GROUP and load:
            host.load()  # hook plugins are registered, so their hooks can be listed
            records.extend(host.records)
            continue
        for ep in plugins.entry_points(group):
            record = plugins.describe(ep, group)
            if load:
                plugins.try_load(ep, record)
            records.append(record)
    return records


@click.group("plugins")
def plugins_group() -> None:
    """Inspect installed plugins."""


@plugins_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
@click.option("--no-load", is_flag=True, help="Read metadata only; do not import plugins.")
def list_command(as_json: bool, no_load: bool) -> None:
    """Every entry point in the elastic.* groups and whether it loads."""
    records = load_records(load=not no_load)
    if as_json:
        click.echo(json.dumps([asdict(r) for r in records], indent=2))
        return
    headers = ("GROUP", "NAME", "DISTRIBUTION", "VERSION", "OBJECT", "STATUS")
    rows = [
        (
            r.group,
            r.name,
            r.distribution,
            r.version,
            r.target,
            r.status + (f": {r.error}" if r.error else ""),
        )
        for r in records
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    for row in (headers, *rows):
        cells = (str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        click.echo("  ".join(cells).rstrip())
