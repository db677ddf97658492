"""The built-in metrics sinks: ``console``, ``jsonl`` and ``prometheus``.

Each class is its own factory: ``Sink(arg)`` where ``arg`` is the text after ``NAME:``.

Where the file sinks write, first match wins:

- ``jsonl``: ``jsonl:PATH``, else ``$ELASTIC_METRICS_JSONL``, else
  ``$ELASTIC_METRICS_DIR/metrics.jsonl``, else ``./elastic-metrics.jsonl``.
- ``prometheus``: ``prometheus:PATH``, else ``$ELASTIC_METRICS_PROMETHEUS``, else
  ``$ELASTIC_METRICS_DIR/metrics.prom``, else ``./elastic-metrics.prom``.

The metrics hook plugin sets ``ELASTIC_METRICS_DIR`` to the run's log dir when there is
one, and hands workers the resolved paths. Prometheus files are per process (workers add
``.rank<N>`` before ``.prom``) because each rewrites its whole file; jsonl files are
shared: every line is one ``O_APPEND`` write, which the kernel keeps whole.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from elastic.core.metrics import MetricData
from elastic.core.plugin.extras import needs_extra

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

ENV_DIR = "ELASTIC_METRICS_DIR"
ENV_JSONL = "ELASTIC_METRICS_JSONL"
ENV_PROMETHEUS = "ELASTIC_METRICS_PROMETHEUS"


def _resolve(arg: str | None, env_var: str, filename: str) -> Path:
    if arg:
        return Path(arg).expanduser().absolute()
    if os.environ.get(env_var):
        return Path(os.environ[env_var]).expanduser().absolute()
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser().absolute() / filename
    return Path.cwd() / f"elastic-{filename}"


def _source(data: MetricData) -> str:
    return "agent" if data.rank is None else f"rank{data.rank}"


class ConsoleSink:
    """One line per metric on stderr: ``[elastic-metric] TS GROUP.NAME=VALUE (SOURCE)``."""

    def __init__(self, arg: str | None = None) -> None:
        self.path = None  # nothing for workers to resolve

    def emit(self, data: MetricData) -> None:
        print(
            f"[elastic-metric] {data.timestamp:.3f} {data.group}.{data.name}={data.value:g} "
            f"({_source(data)} pid={data.pid})",
            file=sys.stderr,
            flush=True,
        )


class JsonlSink:
    """One JSON object per line: ts, group, name, value, rank, pid, host."""

    def __init__(self, arg: str | None = None) -> None:
        self.path = _resolve(arg, ENV_JSONL, "metrics.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._host = socket.gethostname()
        # O_APPEND: lines from the agent and every worker interleave but never tear.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, data: MetricData) -> None:
        record = {
            "ts": data.timestamp,
            "group": data.group,
            "name": data.name,
            "value": data.value,
            "rank": data.rank,
            "pid": data.pid,
            "host": self._host,
        }
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


def prometheus_name(group: str, name: str) -> str:
    """``("torchelastic", "rendezvous.duration")`` -> ``torchelastic_rendezvous_duration``."""
    text = _INVALID.sub("_", f"{group}_{name}")
    return f"_{text}" if text[0].isdigit() else text


class PrometheusSink:
    """A text-exposition file for node_exporter's textfile collector, rendered by
    ``prometheus-client`` (the same library serves the agent's ``/metrics``).

    For each metric: a gauge with its last value and a counter of observations
    (``NAME_observations_total``), labelled with the host (and the rank in a worker); a
    deprecated alias says so, and names its new name, in both families' help. The
    whole file is rewritten on every metric by ``prometheus_client.write_to_textfile``
    (a temp file in the same directory, then a rename), so the collector never reads half
    a file.
    """

    def __init__(self, arg: str | None = None) -> None:
        with needs_extra("the prometheus metrics sink"):
            from prometheus_client import CollectorRegistry

        path = _resolve(arg, ENV_PROMETHEUS, "metrics.prom")
        rank = os.environ.get("RANK")
        if rank is not None:  # a worker: one file per process, the agent keeps its own
            stem = path.name[: -len(".prom")] if path.name.endswith(".prom") else path.name
            path = path.with_name(f"{stem}.rank{rank}.prom")
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._new_name: dict[str, str] = {}  # a deprecated alias -> its new name
        self._labels = {"host": socket.gethostname()}
        if rank is not None:
            self._labels["rank"] = rank
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)  # type: ignore[arg-type]  # collect() below

    def emit(self, data: MetricData) -> None:
        key = prometheus_name(data.group, data.name)
        self._last[key] = data.value
        self._count[key] = self._count.get(key, 0) + 1
        if data.alias_of is not None:
            self._new_name[key] = prometheus_name(data.group, data.alias_of)
        self._write()

    def collect(self) -> Iterator[Metric]:
        """prometheus-client's collector protocol: the families, at exposition time."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names = sorted(self._labels)
        values = [self._labels[n] for n in names]
        for key in sorted(self._last):
            new = self._new_name.get(key)
            deprecated = f"deprecated alias of {new}{{}}, emitted for one more release"
            gauge_help = deprecated.format("") if new else "last value put by elastic"
            gauge = GaugeMetricFamily(key, gauge_help, labels=names)
            gauge.add_metric(values, self._last[key])
            yield gauge
            count_help = (
                deprecated.format("_observations") if new else "observations put by elastic"
            )
            count = CounterMetricFamily(f"{key}_observations", count_help, labels=names)
            count.add_metric(values, self._count[key])
            yield count

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self._registry).decode()

    def _write(self) -> None:
        from prometheus_client import write_to_textfile

        write_to_textfile(str(self.path), self._registry)
