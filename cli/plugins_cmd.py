"""``elastic plugins list``: what is installed in the ``elastic.*`` groups and whether it loads."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import click
from elastic.core.plugin.entry_points import GROUPS, HOOK_GROUP, PluginRecord, discover

if TYPE_CHECKING:
    from elastic.core.plugin.named import NamedPluginGroup


def named_groups() -> dict[str, NamedPluginGroup[Any]]:
    """The pick-by-name groups (importing their modules is cheap: no plugin, no torch)."""
    from elastic.core.checkpoint import CHECKPOINTERS
    from elastic.core.metrics import SINKS
    from elastic.core.rendezvous.registry import BACKENDS

    return {g.group: g for g in (BACKENDS, SINKS, CHECKPOINTERS)}


def load_records(load: bool) -> list[PluginRecord]:
    """Every entry point; with ``load``, each imported once to report its status."""
    if not load:
        return discover()
    from elastic.core.plugin.host import PluginHost

    named = named_groups()
    records: list[PluginRecord] = []
    for group in GROUPS:
        if group == HOOK_GROUP:
            host = PluginHost()  # hook plugins are registered, so their hooks can be listed
            host.load()
            records.extend(host.records)
        else:
            records.extend(named[group].records(load=True))
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
