"""Entry-point metadata: what is installed in the ``elastic.*`` groups, read without
importing anything, and the record of what happened when one was loaded.

Reading metadata is cheap (~60 ms for every installed distribution); importing a plugin
is not, so discovery and loading are separate steps. ``importlib.metadata`` already
lists each distribution once however often it appears on ``sys.path``, so two entry
points with one name in one group always come from two distributions: a conflict.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from dataclasses import dataclass, field

GROUPS = ("elastic.rendezvous", "elastic.plugins", "elastic.metrics", "elastic.checkpoint")
HOOK_GROUP = "elastic.plugins"


@dataclass
class PluginRecord:
    """One entry point (or in-process registration) and what happened when it was loaded."""

    group: str
    name: str
    target: str
    distribution: str
    version: str
    status: str = "not loaded"  # "ok", "error", "disabled" or "not loaded"
    error: str | None = None
    hooks: list[str] = field(default_factory=list)

    @property
    def origin(self) -> str:
        """``dist==version (module:attr)``, how errors name a plugin."""
        return f"{self.distribution}=={self.version} ({self.target})"

    def failed(self, message: str) -> None:
        self.status, self.error = "error", message


# (sys.path, each entry's mtime) as they were at the scan -> GROUPS' entry points
_scanned: dict[tuple[tuple[str, int], ...], dict[str, md.EntryPoints]] = {}


def _mtime(path: str) -> int:
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return -1


def _installed(group: str) -> md.EntryPoints:
    """A group's entry points. A scan reads every distribution's metadata (~12 ms here)
    and an agent asks for several groups, so one scan serves all of GROUPS while
    ``sys.path`` and its folders stay as they were (installing a distribution into a
    folder changes that folder's mtime)."""
    if group not in GROUPS:
        return md.entry_points(group=group)
    key = tuple((p, _mtime(p)) for p in sys.path)
    groups = _scanned.get(key)
    if groups is None:
        everything = md.entry_points()
        groups = {g: everything.select(group=g) for g in GROUPS}
        _scanned.clear()
        _scanned[key] = groups
    return groups[group]


def entry_points(group: str, name: str | None = None) -> list[md.EntryPoint]:
    """The group's entry points (only those called ``name`` if given), sorted by name."""
    found = _installed(group)
    if name is not None:
        found = found.select(name=name)
    return sorted(found, key=lambda ep: (ep.name, ep.value))


def describe(ep: md.EntryPoint, group: str) -> PluginRecord:
    # One parse of the distribution's METADATA (``dist.version`` would parse it again).
    meta = ep.dist.metadata if ep.dist is not None else None
    return PluginRecord(
        group=group,
        name=ep.name,
        target=ep.value,
        distribution=meta["Name"] if meta is not None else "?",
        version=meta["Version"] if meta is not None else "?",
    )


def discover(groups: tuple[str, ...] = GROUPS) -> list[PluginRecord]:
    """Every entry point in ``groups``, from metadata only (nothing is imported)."""
    return [describe(ep, group) for group in groups for ep in entry_points(group)]


def format_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def conflict_message(what: str, name: str, records: list[PluginRecord]) -> str:
    """One line naming every distribution that claims ``name``."""
    origins = " and ".join(sorted(r.origin for r in records))
    return f"{what} {name!r} is claimed by {origins}"
