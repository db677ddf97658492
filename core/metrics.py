"""Metrics: ``put_metric`` and ``timed`` for agent and user code, and the sinks they feed.

Sinks are plugins in the ``elastic.metrics`` entry-point group, chosen by name with
``--metrics-sink NAME[:ARG][,NAME[:ARG]]`` (no sink by default, so ``put_metric`` is a
cheap no-op). A sink entry point is a factory called as ``factory(arg)``, where ``arg``
is the text after ``NAME:`` or None, returning an object with ``emit(data: MetricData)``
and optionally ``close()``.

A sink that raises never stops the job: it is reported once on stderr and dropped. One
sink that fails to load is reported and skipped; the others still run.

Workers do not scan plugins: the agent resolves the spec to explicit paths and passes it
in ``ELASTIC_METRICS_SINK``; a worker's first ``put_metric`` loads only those names.
This module never imports torch.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

from elastic.core.log import say
from elastic.core.plugin.extras import MissingExtraError
from elastic.core.plugin.named import NamedPluginGroup, PluginNotFoundError

GROUP = "elastic.metrics"
DEFAULT_GROUP = "torchelastic"
ENV_SINK = "ELASTIC_METRICS_SINK"  # the sink spec workers (and a bare agent) read

# Names follow Prometheus's conventions (a unit as the suffix, no ``_count`` on a gauge).
# The names they replaced are still emitted beside them, as deprecated aliases, for one
# release (README, "Metrics"); then this table and ``deprecated_alias`` go.
_RENAMED = {"workers.restarts": "workers.restart_count"}
_DURATION = ".duration_seconds"  # was ".duration" (``timed``, rendezvous, run)

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class MetricData:
    """One observation. ``rank`` is the worker's global rank (None in the agent)."""

    name: str
    value: float
    group: str = DEFAULT_GROUP
    timestamp: float = field(default_factory=time.time)
    rank: int | None = None
    pid: int = field(default_factory=os.getpid)
    # Set on a deprecated alias: the name it stands for (sinks may say so).
    alias_of: str | None = None


def deprecated_alias(name: str) -> str | None:
    """The old name still emitted beside ``name`` for one release, or None."""
    if name.endswith(_DURATION):
        return name.removesuffix("_seconds")
    return _RENAMED.get(name)


def observations(
    name: str, value: float, group: str = DEFAULT_GROUP, rank: int | None = None
) -> list[MetricData]:
    """One observation under ``name``, and under its deprecated alias when it has one."""
    first = MetricData(name=name, value=float(value), group=group, rank=rank)
    alias = deprecated_alias(name)
    if alias is None:
        return [first]
    return [first, MetricData(alias, float(value), group, first.timestamp, rank, alias_of=name)]


@runtime_checkable
class MetricSink(Protocol):
    """What a sink factory returns. ``close`` is optional (flush files at run end)."""

    def emit(self, data: MetricData) -> None: ...


SinkFactory = Callable[[str | None], MetricSink]


class SinkNotFoundError(PluginNotFoundError):
    """No sink has the requested name, two claim it, or it cannot be loaded."""


SINKS: NamedPluginGroup[SinkFactory] = NamedPluginGroup(
    GROUP, "metrics sink", "sinks", SinkNotFoundError, ("console", "jsonl", "prometheus")
)


def register_sink(name: str, factory: SinkFactory) -> None:
    """Register a sink in-process (no entry point needed), e.g. from a test or a script."""
    SINKS.register(name, factory)


def parse_sink_spec(spec: str | None) -> list[tuple[str, str | None]]:
    """``"console,jsonl:/tmp/m.jsonl"`` -> ``[("console", None), ("jsonl", "/tmp/m.jsonl")]``.

    Only the first ``:`` separates name from argument, so paths may hold colons (but not
    commas)."""
    items: list[tuple[str, str | None]] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, arg = part.partition(":")
        items.append((name.strip(), arg.strip() if sep else None))
    return items


def known_sink_names() -> list[str]:
    """Names from entry-point metadata (nothing is imported) plus in-process ones."""
    return SINKS.names()


def validate_sink_names(spec: str | None) -> str | None:
    """Raise ValueError (one line) for an unknown or doubly claimed sink name, or a
    built-in sink installed without its extra; returns ``spec``. Checked before anything
    starts; any other failure to load a sink is reported and skipped at start."""
    for name, _arg in parse_sink_spec(spec):
        try:
            SINKS.check(name)
        except SinkNotFoundError as exc:
            raise ValueError(str(exc)) from None
        try:
            SINKS.load(name)
        except SinkNotFoundError as exc:
            if isinstance(exc.__cause__, MissingExtraError):
                raise ValueError(str(exc)) from None
    return spec


def _report(message: str) -> None:
    say(f"elastic: {message}", logging.WARNING)


def _find_factories(names: list[str]) -> dict[str, SinkFactory]:
    """Load the factories for ``names`` only; one that fails is reported and left out."""
    found: dict[str, SinkFactory] = {}
    for name in names:
        try:
            found[name] = SINKS.load(name)
        except SinkNotFoundError as exc:
            _report(f"{exc}; it is skipped")
    return found


def build_sinks(spec: str | None) -> list[tuple[str, MetricSink]]:
    """Create one sink per item of ``spec``; a factory that raises is reported and skipped."""
    items = parse_sink_spec(spec)
    factories = _find_factories(list(dict.fromkeys(name for name, _ in items)))
    sinks: list[tuple[str, MetricSink]] = []
    for name, arg in items:
        factory = factories.get(name)
        if factory is None:
            continue
        try:
            sinks.append((name, factory(arg)))
        except Exception as exc:  # a broken sink must never stop the job
            _report(
                f"metrics sink {name!r} could not start ({type(exc).__name__}: {exc}); "
                "it is skipped"
            )
    return sinks


class SinkManager:
    """Fans each metric out to every sink; drops (and reports once) a sink that raises."""

    def __init__(self, sinks: list[tuple[str, MetricSink]] | None = None) -> None:
        self.sinks: list[tuple[str, MetricSink]] = list(sinks or [])
        # Sinks write files; one lock keeps lines whole when threads emit concurrently.
        self._lock = threading.Lock()

    def add(self, name: str, sink: MetricSink) -> None:
        with self._lock:
            self.sinks.append((name, sink))

    def emit(self, data: MetricData) -> None:
        with self._lock:
            for entry in list(self.sinks):
                name, sink = entry
                try:
                    sink.emit(data)
                except Exception as exc:
                    self.sinks.remove(entry)
                    _report(
                        f"metrics sink {name!r} failed ({type(exc).__name__}: {exc}); "
                        "it is dropped for the rest of this run"
                    )

    def close(self) -> None:
        with self._lock:
            sinks, self.sinks = self.sinks, []
        for name, sink in sinks:
            close = getattr(sink, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as exc:
                _report(f"metrics sink {name!r} failed to close ({type(exc).__name__}: {exc})")


_manager: SinkManager | None = None
_manager_lock = threading.Lock()


def configure_sinks(spec: str | None) -> SinkManager:
    """Replace the process's sinks with those named by ``spec`` (None or "" for none)."""
    global _manager
    new = SinkManager(build_sinks(spec))
    with _manager_lock:
        old, _manager = _manager, new
    if old is not None:
        old.close()
    return new


def sink_manager() -> SinkManager:
    """The process's sinks; on first use they come from ``ELASTIC_METRICS_SINK``."""
    global _manager
    if _manager is None:
        spec = os.environ.get(ENV_SINK)
        with _manager_lock:
            if _manager is None:
                _manager = SinkManager(build_sinks(spec) if spec else [])
    return _manager


def close_sinks() -> None:
    """Flush and forget every sink (the next ``put_metric`` reads the env again)."""
    global _manager
    with _manager_lock:
        old, _manager = _manager, None
    if old is not None:
        old.close()


def _rank() -> int | None:
    value = os.environ.get("RANK")
    return int(value) if value and value.lstrip("-").isdigit() else None


def put_metric(name: str, value: float, group: str = DEFAULT_GROUP) -> None:
    """Record one value (e.g. ``put_metric("rendezvous.duration", 1.2)``); never raises."""
    manager = sink_manager()
    if not manager.sinks:
        return
    manager.emit(MetricData(name=name, value=float(value), group=group, rank=_rank()))


class timed:  # lower case: it is used as a decorator, so it reads like a function
    """Time a function or a block: emits ``NAME.duration_seconds`` and ``NAME.success``
    on success, ``NAME.failure`` when it raises (the exception still propagates). The
    old ``NAME.duration`` goes out too, as a deprecated alias, for one release.

    ``@timed("checkpoint.save")`` on a function, or ``with timed("data.load"):``.
    """

    def __init__(self, name: str, group: str = DEFAULT_GROUP) -> None:
        self.name = name
        self.group = group
        # Per-thread stacks: one instance may be entered by several threads or nested.
        self._local = threading.local()

    def _record(self, elapsed: float, ok: bool) -> None:
        if ok:
            manager = sink_manager()
            for data in observations(f"{self.name}{_DURATION}", elapsed, self.group, _rank()):
                if manager.sinks:
                    manager.emit(data)
            put_metric(f"{self.name}.success", 1, self.group)
        else:
            put_metric(f"{self.name}.failure", 1, self.group)

    def __enter__(self) -> timed:
        self._local.__dict__.setdefault("starts", []).append(time.perf_counter())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._record(time.perf_counter() - self._local.starts.pop(), exc_type is None)

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = func(*args, **kwargs)
            except BaseException:
                self._record(time.perf_counter() - start, False)
                raise
            self._record(time.perf_counter() - start, True)
            return result

        return wrapper  # type: ignore[return-value]
