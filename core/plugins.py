"""Discovery and loading of entry-point plugins, and the pluggy manager that calls them.

Reading entry-point metadata is cheap; importing plugin modules is not, so listing
(``discover``) never imports and loading happens once, on first use. One plugin that
fails to import is recorded and skipped: it never breaks the CLI or the other plugins.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import pluggy
from elastic.core import hookspecs

log = logging.getLogger(__name__)

GROUPS = ("elastic.rendezvous", "elastic.plugins", "elastic.metrics", "elastic.checkpoint")
HOOK_GROUP = "elastic.plugins"


@dataclass
class PluginRecord:
    """One entry point and what happened when it was loaded."""

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
        return f"{self.distribution}=={self.version} ({self.target})"


def entry_points(group: str) -> list[md.EntryPoint]:
    return sorted(md.entry_points(group=group), key=lambda ep: ep.name)


def describe(ep: md.EntryPoint, group: str) -> PluginRecord:
    dist = ep.dist
    return PluginRecord(
        group=group,
        name=ep.name,
        target=ep.value,
        distribution=dist.metadata["Name"] if dist is not None else "?",
        version=dist.version if dist is not None else "?",
    )


def discover(groups: tuple[str, ...] = GROUPS) -> list[PluginRecord]:
    """Every entry point in ``groups``, from metadata only (nothing is imported)."""
    return [describe(ep, group) for group in groups for ep in entry_points(group)]


def format_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def try_load(ep: md.EntryPoint, record: PluginRecord) -> Any:
    """Import ``ep``; on failure mark ``record`` broken and return None."""
    try:
        obj = ep.load()
    except Exception as exc:  # a broken plugin must never break the launcher
        record.status, record.error = "error", format_exception(exc)
        return None
    record.status = "ok"
    return obj


def hook_plugin_allowed(name: str) -> bool:
    """``ELASTIC_DISABLE_PLUGIN_AUTOLOAD=1`` loads only names in ``ELASTIC_PLUGINS``."""
    allowlist = {n.strip() for n in os.environ.get("ELASTIC_PLUGINS", "").split(",") if n.strip()}
    if os.environ.get("ELASTIC_DISABLE_PLUGIN_AUTOLOAD", "") not in {"", "0"}:
        return name in allowlist
    return not allowlist or name in allowlist


class PluginHost:
    """Loads the ``elastic.plugins`` group into a pluggy manager and calls hooks.

    ``notify`` isolates implementations (a raising one is reported once and dropped);
    ``call_strict`` lets exceptions through for hooks the user depends on.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self._loaded = False
        self._lock = threading.Lock()

    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            for ep in entry_points(HOOK_GROUP):
                record = describe(ep, HOOK_GROUP)
                self.records.append(record)
                if not hook_plugin_allowed(ep.name):
                    record.status = "disabled"
                    continue
                obj = try_load(ep, record)
                if obj is not None:
                    self.register(obj, ep.name, record)

    def register(self, plugin: object, name: str, record: PluginRecord | None = None) -> None:
        if self.pm.has_plugin(name):
            previous = self.pm.get_plugin(name)
            if previous is plugin:
                return
            message = f"plugin name {name!r} is registered twice; the second is ignored"
            if record is not None:
                record.status, record.error = "error", message
            log.warning(message)
            return
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            if record is None:
                raise
            record.status, record.error = "error", format_exception(exc)
            return
        if record is not None:
            record.hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        self.load()
        caller = getattr(self.pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception as exc:
                print(
                    f"elastic: plugin {impl.plugin_name!r} failed in {hook_name} "
                    f"({format_exception(exc)}); it is disabled for the rest of this run",
                    file=sys.stderr,
                )
                if self.pm.is_registered(impl.plugin):
                    self.pm.unregister(impl.plugin)

    def call_strict(self, hook_name: str, **kwargs: Any) -> list[Any]:
        self.load()
        return getattr(self.pm.hook, hook_name)(**kwargs)


_host: PluginHost | None = None


def plugin_host() -> PluginHost:
    """The process-wide plugin host (created on first use)."""
    global _host
    if _host is None:
        _host = PluginHost()
    return _host
