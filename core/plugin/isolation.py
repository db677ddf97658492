"""One plugin that raises must not stop the others: isolation that leaves pluggy in charge.

pluggy stops a broadcast at the first implementation that raises. For lifecycle hooks we
want the job to go on, so the plugin host registers with pluggy not the plugin itself
but a ``GuardedPlugin``: the same hook implementations, where each one of an isolated
hook is replaced by a guard made with ``functools.wraps``. The guard keeps the original's
signature (pluggy reads argument names through ``__wrapped__``) and its hookimpl marker
(``tryfirst``, ``trylast``, ``hookwrapper``, ``wrapper``, copied with ``__dict__``), so
pluggy orders, calls and collects exactly as it would for the plugin itself. The guard
only decides what an ``Exception`` means: ``on_failure`` is told (the host reports the
plugin once and unregisters it) and the call goes on as if the implementation had
returned None, or, for a wrapper, had handed the result through unchanged.
``BaseException`` (an agent signal, ``KeyboardInterrupt``) is never swallowed.

While a guarded implementation runs, ``current_plugin()`` names its plugin (the option
parser uses it to know whose option is being added).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Generator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import pluggy

T = TypeVar("T")
OnFailure = Callable[[str, str, Exception], None]  # (plugin name, hook name, exception)

_current: ContextVar[str | None] = ContextVar("elastic_current_plugin", default=None)


def current_plugin() -> str | None:
    """The name of the plugin whose (isolated) hook implementation is running, if any."""
    return _current.get()


def _as(plugin: str, fn: Callable[..., T], *args: Any) -> T:
    token = _current.set(plugin)
    try:
        return fn(*args)
    finally:
        _current.reset(token)


def _guard_plain(fn: Callable[..., Any], plugin: str, hook: str, on_failure: OnFailure) -> Any:
    @functools.wraps(fn)
    def guard(*args: Any) -> Any:
        try:
            return _as(plugin, fn, *args)
        except Exception as exc:
            on_failure(plugin, hook, exc)
            return None

    return guard


def _guard_old_style(fn: Callable[..., Any], plugin: str, hook: str, on_failure: OnFailure) -> Any:
    """``hookwrapper=True``: the wrapper receives pluggy's ``Result`` at its yield."""

    @functools.wraps(fn)
    def guard(*args: Any) -> Generator[None, Any, None]:
        try:
            gen = _as(plugin, fn, *args)
            _as(plugin, next, gen)
        except Exception as exc:  # StopIteration too: a wrapper that did not yield
            on_failure(plugin, hook, exc)
            yield
            return
        outcome = yield
        try:
            _as(plugin, gen.send, outcome)
        except StopIteration:
            return
        except Exception as exc:
            on_failure(plugin, hook, exc)
            return
        gen.close()
        on_failure(plugin, hook, RuntimeError("the hookwrapper yielded twice"))

    return guard


def _guard_wrapper(fn: Callable[..., Any], plugin: str, hook: str, on_failure: OnFailure) -> Any:
    """``wrapper=True``: the wrapper gets the result at its yield and returns the result."""

    @functools.wraps(fn)
    def guard(*args: Any) -> Generator[None, Any, Any]:
        try:
            gen = _as(plugin, fn, *args)
            _as(plugin, next, gen)
        except Exception as exc:  # StopIteration too: a wrapper that did not yield
            on_failure(plugin, hook, exc)
            return (yield)
        try:
            result = yield
        except BaseException as exc:  # only a BaseException gets here: hand it to the wrapper
            try:
                _as(plugin, gen.throw, exc)
            except StopIteration as stop:
                return stop.value
            gen.close()
            raise
        try:
            _as(plugin, gen.send, result)
        except StopIteration as stop:
            return stop.value
        except Exception as exc:
            on_failure(plugin, hook, exc)
            return result
        gen.close()
        on_failure(plugin, hook, RuntimeError("the wrapper yielded twice"))
        return result

    return guard


class GuardedPlugin:
    """What pluggy registers for ``plugin``: its hook implementations, isolated ones guarded.

    ``plugin`` is the object itself (a module or an instance), kept for the host."""

    def __init__(
        self,
        plugin: object,
        name: str,
        pm: pluggy.PluginManager,
        strict_hooks: Collection[str],
        on_failure: OnFailure,
    ) -> None:
        self.plugin = plugin
        for attr in dir(plugin):
            opts = pm.parse_hookimpl_opts(plugin, attr)
            if opts is None:
                continue
            fn = getattr(plugin, attr)
            hook = opts.get("specname") or attr
            if hook in strict_hooks:
                setattr(self, attr, fn)
            elif opts.get("hookwrapper"):
                setattr(self, attr, _guard_old_style(fn, name, hook, on_failure))
            elif opts.get("wrapper"):
                setattr(self, attr, _guard_wrapper(fn, name, hook, on_failure))
            else:
                setattr(self, attr, _guard_plain(fn, name, hook, on_failure))

    def __repr__(self) -> str:
        return f"<guarded {self.plugin!r}>"
