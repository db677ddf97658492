"""Options that plugins add to ``elastic run`` (the ``elastic_addoption`` hook).

A plugin describes its option to a ``PluginOptionParser``; the CLI turns each one into a
click option (``elastic.cli.plugin_options``) and the Python API uses the defaults. The
parsed value reaches every hook through ``ElasticConfig.plugin_options[dest]``::

    @hookimpl
    def elastic_addoption(parser: PluginOptionParser) -> None:
        parser.addoption("--acme-report", metavar="PATH", help="Write a JSON report here.")

Like torchrun's flags, an option takes dash and underscore spellings (``--acme-report``,
``--acme_report``) and can come from the environment: ``PET_ACME_REPORT`` or
``ELASTIC_ACME_REPORT`` unless ``envvar`` says otherwise; an explicit flag wins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from elastic.core.plugin.isolation import current_plugin


class OptionConflictError(ValueError):
    """An option name or ``dest`` is already taken (by ``elastic run`` or a plugin)."""


@dataclass(frozen=True)
class PluginOption:
    """One option a plugin added. ``convert`` turns the text into the value (and raises
    ``ValueError`` with one line for bad input); ``choices`` restricts the text."""

    names: tuple[str, ...]
    dest: str
    plugin: str
    help: str = ""
    default: Any = None
    convert: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    is_flag: bool = False
    envvars: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def spellings(self) -> list[str]:
        """Every name plus its underscore spelling (``--acme-report``, ``--acme_report``)."""
        out = list(self.names)
        for name in self.names:
            underscored = "--" + name[2:].replace("-", "_")
            if underscored not in out:
                out.append(underscored)
        return out

    def parse(self, value: Any) -> Any:
        """Check and convert a value given as text (the Python API's path)."""
        if not isinstance(value, str):
            return value
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(self.choices)}")
        return self.convert(value) if self.convert is not None else value


class PluginOptionParser:
    """Collects ``PluginOption``s; ``reserved`` holds names and dests already in use."""

    def __init__(self, reserved: Iterable[str] = ()) -> None:
        self.options: list[PluginOption] = []
        self._taken: dict[str, str] = {name: "elastic run" for name in reserved}

    def addoption(
        self,
        *names: str,
        help: str = "",  # noqa: A002 - click's and argparse's name for it
        default: Any = None,
        type: Callable[[str], Any] | None = None,  # noqa: A002
        choices: Sequence[str] | None = None,
        is_flag: bool = False,
        envvar: str | Sequence[str] | None = None,
        metavar: str | None = None,
        dest: str | None = None,
    ) -> None:
        """Add a long option (``--name``). ``type`` converts the text (raise ValueError
        for bad input); ``envvar`` replaces the default ``PET_<DEST>``/``ELASTIC_<DEST>``."""
        if not names or any(not n.startswith("--") or len(n) < 4 for n in names):
            raise ValueError(f"plugin options are long options like --my-flag, got {names!r}")
        dest = dest or names[0][2:].replace("-", "_")
        if envvar is None:
            envvars: tuple[str, ...] = (f"PET_{dest.upper()}", f"ELASTIC_{dest.upper()}")
        else:
            envvars = (envvar,) if isinstance(envvar, str) else tuple(envvar)
        option = PluginOption(
            names=tuple(names),
            dest=dest,
            plugin=current_plugin() or "?",
            help=help,
            default=False if is_flag and default is None else default,
            convert=type,
            choices=tuple(choices) if choices is not None else None,
            is_flag=is_flag,
            envvars=envvars,
            metavar=metavar,
        )
        keys = [*option.spellings, f"dest:{dest}"]
        for key in keys:
            owner = self._taken.get(key)
            if owner is not None:
                what = f"the option {key}" if key.startswith("--") else f"dest {dest!r}"
                raise OptionConflictError(f"{what} is already taken by {owner}")
        for key in keys:
            self._taken[key] = f"plugin {option.plugin!r}"
        self.options.append(option)

    def for_plugins(self, active: Callable[[str], bool]) -> list[PluginOption]:
        """The options of plugins still registered (a plugin that failed is dropped)."""
        return [o for o in self.options if active(o.plugin)]

    def defaults(self) -> dict[str, Any]:
        return {o.dest: o.default for o in self.options}
