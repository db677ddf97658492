"""The hook plugins (``elastic.plugins``): loaded into pluggy, called with pluggy's rules.

One ``PluginHost`` per agent (and one per ``elastic run`` command line). Loading reads
the group's metadata, honours ``ELASTIC_DISABLE_PLUGIN_AUTOLOAD=1`` / ``ELASTIC_PLUGINS``,
imports each allowed plugin once and instantiates it if it is a class, so every agent
gets its own plugin objects. A plugin that fails to import, that two distributions
claim, or whose hookimpls match no hookspec is recorded (``elastic plugins list``) and
skipped: it never breaks the CLI or the other plugins.

Calls go through pluggy's own hook callers (ordering, ``tryfirst``/``trylast``, both
kinds of wrappers); isolation of non-strict hooks is ``elastic.core.plugin.isolation``'s.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Mapping
from typing import Any

import pluggy
from elastic.core.log import say
from elastic.core.plugin import hookspecs
from elastic.core.plugin.config import ElasticConfig
from elastic.core.plugin.entry_points import (
    GROUPS,
    HOOK_GROUP,
    PluginRecord,
    conflict_message,
    describe,
    entry_points,
    format_exception,
)
from elastic.core.plugin.isolation import GuardedPlugin
from elastic.core.plugin.options import PluginOption, PluginOptionParser
from elastic.core.plugin.trace import TRACE_ENV, tracer

__all__ = ["GROUPS", "HOOK_GROUP", "PluginHost", "PluginRecord", "hook_plugin_allowed"]


def hook_plugin_allowed(name: str) -> bool:
    """``ELASTIC_DISABLE_PLUGIN_AUTOLOAD=1`` loads only names in ``ELASTIC_PLUGINS``."""
    allowlist = {n.strip() for n in os.environ.get("ELASTIC_PLUGINS", "").split(",") if n.strip()}
    if os.environ.get("ELASTIC_DISABLE_PLUGIN_AUTOLOAD", "") not in {"", "0"}:
        return name in allowlist
    return not allowlist or name in allowlist


def _say(message: str) -> None:
    say(f"elastic: {message}", logging.WARNING)


class HookManager(pluggy.PluginManager):
    """pluggy's manager, never looking at a plugin's ``_private`` or ``__dunder__`` names.
    pluggy reads each name statically, through the class's whole MRO; what the host
    registers is a ``GuardedPlugin`` instance, whose inherited dunders are most of its
    names: about 1 ms a plugin at every agent's start, a fifth of that without them. Any
    other name marked ``@hookimpl`` is still checked against the hooks, so a misspelled
    hook stays an error."""

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        if name.startswith("_"):
            return None
        return super().parse_hookimpl_opts(plugin, name)


class PluginHost:
    """A pluggy manager with ``elastic.core.plugin.hookspecs`` and the installed hook plugins.

    ``autoload=False`` loads installed plugins only when ``load`` is called explicitly
    (the testing fixtures use it to run with chosen plugins only); ``trace`` defaults to
    ``ELASTIC_TRACE_PLUGINS``.
    """

    def __init__(self, *, autoload: bool = True, trace: bool | None = None) -> None:
        self.pm = HookManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self._objects: dict[str, object] = {}  # name -> the plugin object itself
        self._record_of: dict[str, PluginRecord] = {}
        self._loaded = not autoload
        self._options: list[PluginOption] | None = None
        self._lock = threading.RLock()
        if trace is None:
            trace = os.environ.get(TRACE_ENV, "") not in {"", "0"}
        if trace:
            self.pm.add_hookcall_monitoring(*tracer())

    # --- loading --------------------------------------------------------------------------
    def load(self, names: Collection[str] | None = None) -> None:
        """Load the installed hook plugins (only ``names``, if given) once."""
        with self._lock:
            if self._loaded and names is None:
                return
            self._loaded = True
            found = entry_points(HOOK_GROUP)
            for ep in found:
                if names is not None and ep.name not in names:
                    continue
                if any(r.name == ep.name and r.target == ep.value for r in self.records):
                    continue
                record = describe(ep, HOOK_GROUP)
                self.records.append(record)
                claims = [describe(e, HOOK_GROUP) for e in found if e.name == ep.name]
                if len(claims) > 1:
                    message = conflict_message("hook plugin", ep.name, claims)
                    record.failed(message + "; neither is loaded")
                    if record.origin == max(c.origin for c in claims):  # say it once
                        _say(record.error or message)
                    continue
                if names is None and not hook_plugin_allowed(ep.name):
                    record.status = "disabled"
                    continue
                try:
                    obj = ep.load()
                    if isinstance(obj, type):  # a class: one instance per host (per agent)
                        obj = obj()
                except Exception as exc:  # a broken plugin must never break the launcher
                    record.failed(format_exception(exc))
                    continue
                self.register(obj, ep.name, record)

    def register(self, plugin: object, name: str, record: PluginRecord | None = None) -> None:
        """Register ``plugin`` (a module or an object with hookimpl methods) as ``name``.

        Without a ``record`` (in-process registration) a hookimpl that matches no
        hookspec raises ``pluggy.PluginValidationError``; with one it is recorded."""
        with self._lock:
            if record is None:
                record = PluginRecord(HOOK_GROUP, name, repr(plugin), "(in-process)", "")
            if self.pm.has_plugin(name):
                if self._objects.get(name) is plugin:
                    return
                record.failed(f"a hook plugin named {name!r} is already registered")
                _say(f"{record.error}; {record.origin} is ignored")
                return
            guarded = GuardedPlugin(plugin, name, self.pm, hookspecs.STRICT_HOOKS, self._drop)
            try:
                self.pm.register(guarded, name=name)
                self.pm.check_pending()
            except pluggy.PluginValidationError as exc:
                if self.pm.is_registered(guarded):
                    self.pm.unregister(guarded)
                if record.distribution == "(in-process)":
                    raise
                record.failed(format_exception(exc))
                return
            record.status = "ok"
            record.hooks = sorted(h.name for h in self.pm.get_hookcallers(guarded) or [])
            self._objects[name] = plugin
            self._record_of[name] = record
            if record not in self.records:
                self.records.append(record)

    def unregister(self, name: str) -> None:
        with self._lock:
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            self._objects.pop(name, None)

    def get_plugin(self, name: str) -> object | None:
        """The plugin object registered as ``name`` (the instance, for a class)."""
        return self._objects.get(name)

    def plugin_names(self) -> list[str]:
        return sorted(self._objects)

    def _drop(self, plugin: str, hook: str, exc: Exception) -> None:
        """An isolated hookimpl raised: report once, unregister its plugin."""
        with self._lock:
            if plugin not in self._objects:
                return  # already dropped (e.g. its wrapper failed too)
            message = f"failed in {hook} ({format_exception(exc)})"
            _say(f"plugin {plugin!r} {message}; it is disabled for the rest of this run")
            record = self._record_of.get(plugin)
            if record is not None:
                record.failed(message)
            self.unregister(plugin)

    # --- calling --------------------------------------------------------------------------
    def call(self, hook_name: str, **kwargs: Any) -> list[Any]:
        """Call a hook through pluggy; the list of non-None results in call order."""
        self.load()
        result = getattr(self.pm.hook, hook_name)(**kwargs)
        return list(result or [])

    def implemented(self, hook_name: str) -> bool:
        """Whether any plugin implements ``hook_name``. The agent asks before the hooks it
        calls per worker or per monitor tick, so a run whose plugins do not use them
        makes no such calls (nor trace lines, nor recorded calls)."""
        self.load()
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def call_first(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a ``firstresult`` hook: the first non-None answer, or None."""
        if not self.implemented(hook_name):
            return None
        return getattr(self.pm.hook, hook_name)(**kwargs)

    # The agent's names for ``call``: which hooks are isolated is the hookspecs' decision.
    notify = call
    call_strict = call

    def add_options(self, parser: PluginOptionParser) -> list[PluginOption]:
        """Let every plugin add its options to ``parser`` (``elastic_addoption``); those
        of plugins that failed are left out. The answer is kept for ``options``."""
        self.call("elastic_addoption", parser=parser)
        self._options = parser.for_plugins(self.pm.has_plugin)
        return self._options

    def options(self) -> list[PluginOption]:
        """The plugins' options: asked once per host, so each plugin adds them once."""
        if self._options is None:
            return self.add_options(PluginOptionParser())
        return [o for o in self._options if self.pm.has_plugin(o.plugin)]

    def worker_env(self, config: ElasticConfig) -> dict[str, str]:
        """The merged answers of ``elastic_worker_env``; the first plugin called wins."""
        return self._merged_env("elastic_worker_env", config=config)

    def worker_process_env(self, local_rank: int, error_file: str) -> dict[str, str]:
        """The merged answers of ``elastic_worker_process_env`` for one worker."""
        if not self.implemented("elastic_worker_process_env"):
            return {}
        return self._merged_env(
            "elastic_worker_process_env", local_rank=local_rank, error_file=error_file
        )

    def _merged_env(self, hook: str, **kwargs: Any) -> dict[str, str]:
        merged: dict[str, str] = {}
        for env in reversed(self.call(hook, **kwargs)):
            if isinstance(env, Mapping):
                merged.update({str(k): str(v) for k, v in env.items()})
        return merged
