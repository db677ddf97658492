"""Entry-point metadata: what is installed in the ``elastic.*`` groups, read without
importing anything, and the record of what happened when one was loaded.

Reading metadata is cheap; importing a plugin is not, so discovery and loading are
separate steps. The metadata is read by ``installed`` (the path search of
``importlib.metadata``, without importing it or ``email``), which lists each
distribution once however often it appears on ``sys.path``, so two entry points with one
name in one group always come from two distributions: a conflict.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from elastic.core.plugin import installed

GROUPS = ("elastic.rendezvous", "elastic.plugins", "elastic.metrics", "elastic.checkpoint")
HOOK_GROUP = "elastic.plugins"

# ``importlib.metadata.EntryPoint.pattern``: module, then optional ``:attr`` and ``[extras]``.
_TARGET = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


@dataclass(frozen=True)
class EntryPoint:
    """One installed entry point: ``importlib.metadata.EntryPoint``'s name, value, group
    and distribution, and ``load``."""

    name: str
    value: str
    group: str
    dist: installed.Metadata = field(compare=False, repr=False)

    def load(self) -> Any:
        """Import the module and return it, or the named attribute of it."""
        match = _TARGET.match(self.value)
        if match is None:
            raise ValueError(f"entry point {self.name!r} has an invalid target {self.value!r}")
        obj: Any = importlib.import_module(match.group("module"))
        for attr in filter(None, (match.group("attr") or "").split(".")):
            obj = getattr(obj, attr)
        return obj


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
_scanned: dict[tuple[tuple[str, int], ...], dict[str, list[EntryPoint]]] = {}


def _mtime(path: str) -> int:
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return -1


def parse(text: str, dist: installed.Metadata, groups: tuple[str, ...]) -> list[EntryPoint]:
    """The entry points of ``groups`` in one ``entry_points.txt`` (``importlib.metadata``'s
    reading: stripped lines, ``#`` comments, ``[group]`` headers, ``name = value``; a line
    without ``=`` is skipped where ``importlib.metadata`` would raise)."""
    found: list[EntryPoint] = []
    group: str | None = None
    for line in map(str.strip, text.splitlines()):
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            group = line.strip("[]")
            continue
        name, equals, value = line.partition("=")
        if group in groups and equals:
            found.append(EntryPoint(name.strip(), value.strip(), group, dist))
    return found


def scan(groups: tuple[str, ...]) -> list[EntryPoint]:
    """Every installed entry point of ``groups``, in ``importlib.metadata``'s order."""
    if installed.exotic():
        import importlib.metadata as md

        everything = md.entry_points()
        return [
            EntryPoint(ep.name, ep.value, ep.group, ep.dist)
            for group in groups
            for ep in everything.select(group=group)
            if ep.dist is not None
        ]
    found: list[EntryPoint] = []
    for dist in installed.distributions():
        text = dist.read_text("entry_points.txt")
        if text and any(f"[{group}]" in text for group in groups):
            found.extend(parse(text, dist, groups))
    return found


def _installed(group: str) -> list[EntryPoint]:
    """A group's entry points. A scan lists every ``sys.path`` folder and reads each
    distribution's ``entry_points.txt``, and an agent asks for several groups, so one
    scan serves all of GROUPS while ``sys.path`` and its folders stay as they were
    (installing or removing a distribution changes its folder's mtime)."""
    if group not in GROUPS:
        return scan((group,))
    key = tuple((p, _mtime(p)) for p in sys.path)
    groups = _scanned.get(key)
    if groups is None:
        everything = scan(GROUPS)
        groups = {g: [ep for ep in everything if ep.group == g] for g in GROUPS}
        _scanned.clear()
        _scanned[key] = groups
    return groups[group]


def entry_points(group: str, name: str | None = None) -> list[EntryPoint]:
    """The group's entry points (only those called ``name`` if given), sorted by name."""
    found = [ep for ep in _installed(group) if name is None or ep.name == name]
    return sorted(found, key=lambda ep: (ep.name, ep.value))


def describe(ep: EntryPoint, group: str) -> PluginRecord:
    fields = installed.headers(ep.dist)  # read once per distribution and scan
    return PluginRecord(
        group=group,
        name=ep.name,
        target=ep.value,
        distribution=fields.get("name", "?"),
        version=fields.get("version", "?"),
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
