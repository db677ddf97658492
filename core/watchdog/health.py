"""``--health-port``: the agent's HTTP health endpoint, served from a daemon thread.

- ``GET /healthz`` (liveness): 200 while the agent's own loop runs: it is inside a bounded
  wait (the rendezvous, the exit barrier, the sleep between two monitor ticks) or left
  its last one less than the liveness bound ago (``core/workers/loop_clock.py``:
  ``--shutdown-timeout`` + ``--preemption-grace`` + 60 s, or ``ELASTIC_LIVENESS_TIMEOUT``);
  503 ``stuck: ...`` otherwise (a hook that never returns, a deadlock). A liveness probe
  then restarts the pod, as it should.
- ``GET /readyz`` (readiness): the same verdict as ``/healthz``, with the phase as the
  body. Never 503 because the rendezvous is not complete: behind a headless Service a
  not-ready pod loses its DNS name, and the rendezvous needs that name to complete.
- ``GET /progressz``: 200 while the workers run and make progress; 503 with the reason
  while waiting for the rendezvous, while a worker is not progressing or has stalled, and
  while restarting. For dashboards and alerts, never a probe.
- ``GET /metrics``: Prometheus text exposition, rendered by ``prometheus-client`` from
  the agent's own figures at scrape time, plus the agent process's CPU and memory.

Bound when the agent is created, so a port in use is one line (exit status 2) before
anything starts. ``prometheus-client`` is imported only when the endpoint is on; torch
never is.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from elastic.core.plugin.extras import needs_extra
from elastic.core.plugin.hookspecs import hookimpl
from elastic.core.workers.loop_clock import stuck_bound

if TYPE_CHECKING:
    from http.server import BaseHTTPRequestHandler

    from elastic.core.interfaces.spec import WorkerSpec
    from elastic.core.watchdog.beats import WorkerProgress
    from elastic.core.watchdog.file_timer import FileTimerServer
    from elastic.core.workers.loop_clock import LoopClock

ENV_PORT = "TORCHELASTIC_HEALTH_CHECK_PORT"  # torch's name, read by `elastic run`
ENV_LIVENESS = "ELASTIC_LIVENESS_TIMEOUT"  # seconds outside any wait before /healthz fails


METRICS = {  # /metrics: name -> (kind, help)
    "elastic_agent_live": ("gauge", "1 while /healthz and /readyz answer 200"),
    "elastic_workers_progressing": ("gauge", "1 while /progressz answers 200"),
    "elastic_workers": ("gauge", "workers running on this node"),
    "elastic_restarts": ("gauge", "restarts spent so far, job-wide (TORCHELASTIC_RESTART_COUNT)"),
    "elastic_round": ("gauge", "rendezvous round of this node"),
    "elastic_stalls": ("counter", "stalls this agent reported"),
    "elastic_stall_timeout_seconds": ("gauge", "--stall-timeout"),
    "elastic_file_timer_requests": ("counter", "FileTimer requests received"),
    "elastic_file_timer_expired": ("counter", "expired FileTimers acted on"),
    "elastic_worker_idle_seconds": ("gauge", "seconds since the worker's last progress"),
    "elastic_worker_heartbeats": ("counter", "elastic.heartbeat() calls"),
    "elastic_worker_cpu_seconds": ("counter", "CPU seconds of the worker's process tree"),
}
# The names the two above replaced (a gauge named like a summary's count, a unit inside
# the name), served beside them as deprecated aliases for one release (README, "Metrics").
DEPRECATED = {
    "elastic_restarts": "elastic_restart_count",
    "elastic_worker_idle_seconds": "elastic_worker_seconds_since_progress",
    "elastic_workers_progressing": "elastic_agent_ready",  # /readyz's old meaning
}


class HealthPortError(ValueError):
    """The health endpoint cannot be set up: its port cannot be listened on (in use, or
    not allowed), or ``ELASTIC_LIVENESS_TIMEOUT`` is not a positive number."""


# Named tuples, not dataclasses: every agent imports this module (see AttemptEnd in
# core/agent/outcome.py).
class Sample(NamedTuple):
    """One metric sample: ``kind`` is ``gauge`` or ``counter`` (name without _total)."""

    name: str
    kind: str
    help: str
    value: float
    labels: Mapping[str, str] = MappingProxyType({})


class Readiness(NamedTuple):
    ready: bool
    reason: str


class _Collector:
    """Turns the agent's samples into prometheus-client metric families at scrape time."""

    def __init__(self, samples: Callable[[], list[Sample]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for s in self._samples():
            family = families.get(s.name)
            if family is None:
                kind = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                family = families[s.name] = kind(s.name, s.help, labels=sorted(s.labels))
            family.add_metric([s.labels[k] for k in sorted(s.labels)], s.value)
        yield from families.values()


class HealthServer:
    """The endpoint. ``readiness()`` and ``samples()`` are called on every request."""

    def __init__(
        self,
        port: int,
        readiness: Callable[[], Readiness],
        samples: Callable[[], list[Sample]],
        host: str = "",
        liveness: Callable[[], Readiness] | None = None,
    ) -> None:
        from http.server import ThreadingHTTPServer

        with needs_extra("--health-port (its /metrics)"):
            from prometheus_client import CollectorRegistry, ProcessCollector

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(samples))
        ProcessCollector(registry=self.registry)
        self._readiness = readiness
        self._liveness = liveness or (lambda: Readiness(True, "alive"))
        handler = _make_handler(self)
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise HealthPortError(f"--health-port {port}: cannot listen on it ({reason})") from None
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread: threading.Thread | None = None

    def start(self) -> HealthServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
            )
            self._thread.name = "elastic-health"
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=2)
            self._thread = None
        with contextlib.suppress(OSError):
            self._server.server_close()

    def respond(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path``."""
        text = "text/plain; charset=utf-8"
        route = path.split("?", 1)[0].rstrip("/") or "/"
        checks = {"/healthz": self._liveness, "/readyz": self._liveness}
        checks["/progressz"] = self._readiness
        if route in checks:
            state = checks[route]()
            body = "ok" if route == "/healthz" and state.ready else state.reason
            return (200 if state.ready else 503), text, (body + "\n").encode()
        if route == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        return 404, text, b"not found: try /healthz, /readyz, /progressz or /metrics\n"


def _make_handler(server: HealthServer) -> type[BaseHTTPRequestHandler]:
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            try:
                status, ctype, body = server.respond(self.path)
            except Exception as exc:  # report, never kill the agent's thread
                status, ctype, body = 500, "text/plain", f"error: {exc!r}\n".encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # probes every few seconds must not flood the agent's stderr

    return Handler


class Watched(Protocol):
    """What the endpoint reads from the agent's watchdog (``watch.WorkerWatch``)."""

    phase: str  # "running", or what the agent does instead (the 503 body)
    tracked: dict[int, WorkerProgress]
    timeout: float | None
    stalls: int
    restart_count: int
    round: int
    timers: FileTimerServer | None


def liveness(w: Watched, clock: LoopClock | None, bound: float) -> Readiness:
    """Live unless the agent's loop has been outside every bounded wait for ``bound``
    seconds; the reason names the phase either way (``/readyz``'s body)."""
    outside = clock.outside_wait_for() if clock is not None else 0.0
    if outside >= bound:
        return Readiness(
            False,
            f"stuck: the agent's loop has not come back for {outside:.0f}s "
            f"(bound {bound:g}s) while {w.phase}",
        )
    return Readiness(True, w.phase)


def liveness_bound(spec: WorkerSpec, environ: Mapping[str, str]) -> float:
    """``ELASTIC_LIVENESS_TIMEOUT`` if set, else what the loop's own steps may take."""
    value = environ.get(ENV_LIVENESS, "").strip()
    if not value:
        return stuck_bound(spec.shutdown_timeout, spec.preemption_grace)
    try:
        bound = float(value)
    except ValueError:
        bound = -1.0
    if not bound > 0 or bound == float("inf"):
        raise HealthPortError(f"{ENV_LIVENESS}={value!r}: expected a positive number of seconds")
    return bound


def readiness(w: Watched) -> Readiness:
    """Progressing (``/progressz``) while running with every worker progressing (with
    ``--stall-timeout``: no worker idle for half of it); otherwise the phase or the
    slowest worker is the reason."""
    phase, tracked = w.phase, list(w.tracked.values())
    if phase != "running" or not tracked:
        return Readiness(False, phase)
    mono = time.monotonic()
    slowest = max(tracked, key=lambda p: p.idle(mono))
    idle = slowest.idle(mono)
    if w.timeout and idle >= w.timeout / 2:
        return Readiness(
            False,
            f"not progressing: worker rank {slowest.rank} made no progress for {idle:.1f}s "
            f"(--stall-timeout {w.timeout:g})",
        )
    return Readiness(True, f"running: {len(tracked)} workers, last progress {idle:.1f}s ago")


def samples(w: Watched, live: Callable[[], Readiness]) -> list[Sample]:
    mono = time.monotonic()
    values: dict[str, float] = {
        "elastic_agent_live": float(live().ready),
        "elastic_workers_progressing": float(readiness(w).ready),
        "elastic_workers": len(w.tracked),
        "elastic_restarts": w.restart_count,
        "elastic_round": w.round,
        "elastic_stalls": w.stalls,
    }
    if w.timeout:
        values["elastic_stall_timeout_seconds"] = w.timeout
    if w.timers is not None:
        values["elastic_file_timer_requests"] = w.timers.requests
        values["elastic_file_timer_expired"] = w.timers.expired
    out = [Sample(name, *METRICS[name], value) for name, value in values.items()]
    for p in list(w.tracked.values()):
        labels = {"local_rank": str(p.local_rank), "rank": str(p.rank)}
        for name, value in (
            ("elastic_worker_idle_seconds", p.idle(mono)),
            ("elastic_worker_heartbeats", p.beats),
            ("elastic_worker_cpu_seconds", p.cpu),
        ):
            out.append(Sample(name, *METRICS[name], value, labels))
    return out + [
        Sample(
            DEPRECATED[s.name],
            s.kind,
            f"deprecated alias of {s.name}, served for one more release",
            s.value,
            s.labels,
        )
        for s in out
        if s.name in DEPRECATED
    ]


def serve(
    port: int, watched: Watched, clock: LoopClock | None = None, bound: float = float("inf")
) -> HealthServer:
    """The endpoint for an agent's watchdog (bound now, serving once ``start``ed)."""

    def live() -> Readiness:
        return liveness(watched, clock, bound)

    return HealthServer(
        port, lambda: readiness(watched), lambda: samples(watched, live), liveness=live
    )


class HealthEndpoint:
    """The built-in plugin ``health``: the endpoint bound at creation (so a port in use
    fails before anything starts), served from the agent's start to the end of its run."""

    def __init__(
        self,
        watched: Watched,
        port: int,
        clock: LoopClock | None = None,
        bound: float = float("inf"),
    ) -> None:
        self.server = serve(port, watched, clock, bound)

    @hookimpl
    def elastic_agent_start(self) -> None:
        self.server.start()

    @hookimpl
    def elastic_run_end(self) -> None:
        self.server.stop()
