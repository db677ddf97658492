"""``ELASTIC_TRACE_PLUGINS=1``: every hook call on stderr, as datasette's
``DATASETTE_TRACE_PLUGINS`` does it, through pluggy's ``add_hookcall_monitoring``.

Two lines per call: the hook, its arguments (short reprs) and the implementations in
the order pluggy calls them (wrappers first, then ``tryfirst`` ... ``trylast``); then
what it returned or raised and how long it took.
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import pluggy
from elastic.core.log import say

TRACE_ENV = "ELASTIC_TRACE_PLUGINS"

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


def short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str | int | bool | type(None) | list | tuple | dict):
        return _repr.repr(value)
    return f"<{type(value).__name__}>"


def call_order(impls: Sequence[pluggy.HookImpl]) -> list[str]:
    """Plugin names in the order pluggy calls them (it walks its list backwards)."""
    labels = []
    for impl in reversed(impls):
        kind = " (wrapper)" if impl.wrapper else " (hookwrapper)" if impl.hookwrapper else ""
        labels.append(f"{impl.plugin_name}{kind}")
    return labels


def tracer(
    stream: IO[str] | None = None,
) -> tuple[Callable[..., None], Callable[..., None]]:
    """The ``before`` and ``after`` callbacks for ``pm.add_hookcall_monitoring``."""
    started: dict[int, float] = {}

    def out(line: str) -> None:
        if stream is None:
            say(f"elastic: trace: {line}")
        else:
            print(f"elastic: trace: {line}", file=stream, flush=True)

    def before(hook: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
        started[id(kwargs)] = time.perf_counter()
        args = ", ".join(f"{k}={short(v)}" for k, v in kwargs.items())
        out(f"{hook}({args}) -> {', '.join(call_order(impls)) or 'no implementation'}")

    def after(
        outcome: pluggy.Result[Any],
        hook: str,
        impls: Sequence[pluggy.HookImpl],
        kwargs: Mapping[str, Any],
    ) -> None:
        ms = (time.perf_counter() - started.pop(id(kwargs), time.perf_counter())) * 1000
        if outcome.exception is not None:
            exc = outcome.exception
            out(f"{hook} raised {type(exc).__name__}: {exc} ({ms:.1f} ms)")
        else:
            out(f"{hook} returned {short(outcome.get_result())} ({ms:.1f} ms)")

    return before, after
