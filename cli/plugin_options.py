"""``elastic run``'s options from plugins: the click side of ``elastic_addoption``.

``RunCommand`` adds the options of the installed hook plugins when ``elastic run`` itself
parses its arguments (so ``elastic --help`` never loads a plugin), shows them in
``--help`` under each plugin's name, and leaves the plugin host and the values in the
click context for the command to hand to the launcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from elastic.core.log import say
from elastic.core.plugin.options import PluginOption, PluginOptionParser

if TYPE_CHECKING:
    from elastic.core.plugin.host import PluginHost

HOST_KEY = "elastic.plugin_host"
OPTIONS_KEY = "elastic.plugin_options"


class ConvertedBy(click.ParamType):
    """A plugin's ``type=`` converter; its ValueError becomes click's one-line error."""

    def __init__(self, option: PluginOption) -> None:
        self.option = option
        self.name = option.metavar or "TEXT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.option.parse(value)
        except ValueError as exc:
            hint = f"'{self.option.names[0]}'"
            raise click.BadParameter(str(exc), ctx, param, param_hint=hint) from None


def to_click(option: PluginOption) -> click.Option:
    kwargs: dict[str, Any] = {
        "help": option.help,
        "envvar": list(option.envvars),
        "show_envvar": False,
        "default": option.default,
    }
    if option.is_flag:
        kwargs["is_flag"] = True
    elif option.choices is not None:
        kwargs["type"] = click.Choice(option.choices)
        kwargs["show_default"] = option.default is not None
    else:
        kwargs["type"] = ConvertedBy(option)
        kwargs["metavar"] = option.metavar
    return click.Option([*option.spellings, option.dest], **kwargs)


def reserved_names(params: list[click.Parameter]) -> list[str]:
    names = [f"dest:{p.name}" for p in params]
    for param in params:
        names += [n for n in (*param.opts, *param.secondary_opts) if n.startswith("--")]
    return names


class RunCommand(click.Command):
    """A click command whose options grow by those of the installed hook plugins."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core_params = list(self.params)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from elastic.core.plugin.host import PluginHost  # only `elastic run` pays for pluggy

        host = PluginHost()
        options = host.add_options(PluginOptionParser(reserved_names(self.core_params)))
        ctx.meta[HOST_KEY], ctx.meta[OPTIONS_KEY] = host, options
        first_argument = next(
            (i for i, p in enumerate(self.core_params) if isinstance(p, click.Argument)),
            len(self.core_params),
        )
        self.params = [
            *self.core_params[:first_argument],
            *(to_click(o) for o in options),
            *self.core_params[first_argument:],
        ]
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Core options first, then one section per plugin with the options it added."""
        options: list[PluginOption] = ctx.meta.get(OPTIONS_KEY, [])
        from_plugins = {o.dest for o in options}
        core = [p.get_help_record(ctx) for p in self.get_params(ctx) if p.name not in from_plugins]
        with formatter.section("Options"):
            formatter.write_dl([r for r in core if r is not None])
        by_plugin: dict[str, list[tuple[str, str]]] = {}
        for option in options:
            record = to_click(option).get_help_record(ctx)
            if record is not None:
                by_plugin.setdefault(option.plugin, []).append(record)
        for plugin, rows in sorted(by_plugin.items()):
            with formatter.section(f"Options from plugin {plugin!r}"):
                formatter.write_dl(rows)


def plugin_values(ctx: click.Context, opts: dict[str, Any]) -> dict[str, Any]:
    """Take the plugins' values out of the command's keyword arguments, by dest."""
    return {o.dest: opts.pop(o.dest) for o in ctx.meta.get(OPTIONS_KEY, [])}


# torchrun's --event-log-handler is a core flag of ``elastic run`` (it exists whatever
# loads), and the built-in hook plugin of this name is what acts on it.
EVENT_LOG_PLUGIN = "event_log"


def note_event_log(ctx: click.Context, handler: str) -> None:
    """One line when --event-log-handler asks for events that no loaded plugin writes."""
    host = plugin_host(ctx)
    if handler != "null" and (host is None or host.get_plugin(EVENT_LOG_PLUGIN) is None):
        say(
            f"elastic: --event-log-handler={handler}: the {EVENT_LOG_PLUGIN} plugin is "
            "disabled, so no events are written"
        )


def plugin_host(ctx: click.Context) -> PluginHost | None:
    host: PluginHost | None = ctx.meta.get(HOST_KEY)
    return host
