"""Entry-point metadata: what is installed in the ``elastic.*`` groups, read without
importing anything, and the record of what happened when one was loaded.

Reading metadata is cheap (and kept between starts: ``installed``); importing a plugin
is not, so discovery and loading are separate steps. ``importlib.metadata`` lists each
distribution once however often it appears on ``sys.path``, so two entry points with one
name in one group always come from two distributions: a conflict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.core.plugin.installed import GROUPS, InstalledEntryPoint, installed

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


def entry_points(group: str, name: str | None = None) -> list[InstalledEntryPoint]:
    """The group's entry points (only those called ``name`` if given), sorted by name."""
    found = installed().groups[group]
    return [ep for ep in found if name is None or ep.name == name]


def describe(ep: InstalledEntryPoint, group: str) -> PluginRecord:
    return PluginRecord(
        group=group, name=ep.name, target=ep.value, distribution=ep.distribution, version=ep.version
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
