"""The one loader for every pick-by-name plugin group.

``elastic.rendezvous`` (``--rdzv-backend NAME``), ``elastic.metrics`` (``--metrics-sink
a,b``) and ``elastic.checkpoint`` (``--checkpoint NAME:ARG``) all work the same way:

- a name registered in-process (``register_rendezvous_handler`` and its equivalents)
  wins, but may not take a name an installed distribution already claims;
- otherwise exactly one installed entry point must carry the name: none is an error
  listing the known names, two are an error naming both ``dist==version (module:attr)``
  (which one would win depends on ``sys.path`` order, so neither does);
- only the chosen entry point is imported; a failure is recorded (``records``, shown by
  ``elastic plugins list``) and raised as one line naming the distribution.

Why not stevedore's ``DriverManager`` (as of stevedore 5.10): its entry-point cache
(on disk, keyed on the interpreter, each ``sys.path`` entry and each ``entry_points.txt``
with their mtimes, so it does see installs) keeps only each entry point's name, value and
group, so the distribution and its version are gone; its duplicate-name error
(``MultipleMatches``) comes after importing every duplicate and names each loaded
object's ``__qualname__``, not who installed it; an unknown name (``NoMatches``) lists no
known names. What this loader adds is what ``elastic plugins list`` and our errors need:
the name and version of every distribution in a conflict, read from metadata with
none imported; a record of each plugin that failed to load, with its exception; the
known names in the error for an unknown one. It reads the metadata itself for that
(``installed``), after which the one thing left is ``ep.load()``, and serves all three
groups.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from elastic.core.plugin.entry_points import (
    PluginRecord,
    conflict_message,
    describe,
    entry_points,
    format_exception,
)
from elastic.core.plugin.extras import MissingExtraError
from elastic.core.plugin.installed import InstalledEntryPoint

T = TypeVar("T")

INSTALL_HINT = "exist only when elastic-launch is installed: pip install -e ."


class PluginNotFoundError(LookupError):
    """No plugin of a pick-by-name group has the requested name, or it cannot be loaded."""


class NamedPluginGroup(Generic[T]):
    """Plugins of one entry-point group, chosen by name; see the module docstring.

    ``what`` names one plugin in messages (``"rendezvous backend"``), ``plural`` the list
    of known names (``"backends"``), ``builtins`` the names elastic-launch itself ships
    (their absence means the package is not installed, which the error then says).
    """

    def __init__(
        self,
        group: str,
        what: str,
        plural: str,
        error: type[PluginNotFoundError] = PluginNotFoundError,
        builtins: tuple[str, ...] = (),
    ) -> None:
        self.group = group
        self.what = what
        self.plural = plural
        self.error = error
        self.builtins = builtins
        self._registered: dict[str, T] = {}
        self._loads: dict[str, PluginRecord] = {}  # what loading each name did
        self._lock = threading.Lock()

    # --- in-process registration ------------------------------------------------------
    def register(self, name: str, obj: T) -> None:
        """Make ``obj`` available as ``name`` in this process (no entry point needed)."""
        with self._lock:
            previous = self._registered.get(name)
            if previous is not None and previous is not obj:
                raise ValueError(f"a {self.what} named {name!r} is already registered")
            installed = entry_points(self.group, name)
            if installed:
                origins = " and ".join(describe(ep, self.group).origin for ep in installed)
                raise ValueError(f"{self.what} {name!r} is already provided by {origins}")
            self._registered[name] = obj

    def unregister(self, name: str) -> None:
        with self._lock:
            self._registered.pop(name, None)

    # --- lookup -----------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every known name: installed (metadata only, nothing imported) and in-process."""
        return sorted({ep.name for ep in entry_points(self.group)} | set(self._registered))

    def check(self, name: str) -> None:
        """Raise ``error`` for an unknown or doubly claimed name; reads metadata only."""
        self._entry_point(name)

    def load(self, name: str) -> T:
        """The object registered or installed as ``name``; imports that entry point only."""
        ep = self._entry_point(name)
        if ep is None:
            return self._registered[name]
        record = describe(ep, self.group)
        try:
            obj: T = ep.load()
        except MissingExtraError as exc:  # ours, installed without the extra it needs
            record.failed(self._missing_extra(name, exc))
            self._loads[name] = record
            raise self.error(record.error) from exc
        except Exception as exc:  # any import-time error of a plugin is its own
            record.failed(format_exception(exc))
            self._loads[name] = record
            raise self.error(
                f"{self.what} {name!r} from {record.origin} failed to load: {format_exception(exc)}"
            ) from exc
        record.status = "ok"
        self._loads[name] = record
        return obj

    def _entry_point(self, name: str) -> InstalledEntryPoint | None:
        """The one installed entry point for ``name``; None when registered in-process."""
        if name in self._registered:
            return None
        candidates = entry_points(self.group, name)
        if len(candidates) > 1:
            records = [describe(ep, self.group) for ep in candidates]
            message = conflict_message(self.what, name, records)
            for record in records:
                record.failed(message)
            raise self.error(message)
        if not candidates:
            raise self.error(self.unknown_message(name))
        return candidates[0]

    def _missing_extra(self, name: str, exc: MissingExtraError) -> str:
        """The one line for a plugin of ours installed without its extra."""
        return exc.line(f"{self.what} {name!r}")

    def unknown_message(self, name: str) -> str:
        known = self.names()
        hint = ""
        if name in self.builtins or not known:
            hint = f" (the built-in {self.plural} {INSTALL_HINT})"
        listed = ", ".join(known) or "none"
        return f"unknown {self.what} {name!r}; known {self.plural}: {listed}{hint}"

    # --- reporting --------------------------------------------------------------------
    def records(self, load: bool = False) -> list[PluginRecord]:
        """Every installed entry point (and in-process registration) with its status.

        With ``load`` each entry point is imported once to report whether it loads;
        otherwise a name keeps the status of this process's last load of it."""
        found = entry_points(self.group)
        counts: dict[str, list[PluginRecord]] = {}
        out: list[PluginRecord] = []
        for ep in found:
            record = describe(ep, self.group)
            counts.setdefault(ep.name, []).append(record)
            out.append(record)
            previous = self._loads.get(ep.name)
            if load:
                try:
                    ep.load()
                    record.status = "ok"
                except MissingExtraError as exc:
                    record.failed(self._missing_extra(ep.name, exc))
                except Exception as exc:
                    record.failed(format_exception(exc))
            elif previous is not None and previous.target == record.target:
                record.status, record.error = previous.status, previous.error
        for name, records in counts.items():
            if len(records) > 1:
                message = conflict_message(self.what, name, records)
                for record in records:
                    record.failed(message)
        for name, obj in sorted(self._registered.items()):
            target = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', obj)}"
            out.append(PluginRecord(self.group, name, target, "(in-process)", "", status="ok"))
        return out
