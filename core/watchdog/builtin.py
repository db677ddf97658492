"""The watchdog's built-in plugins, registered on each agent's plugin host as pytest
registers its own: through the same hooks as everyone's.

``ELASTIC_DISABLE_PLUGIN_AUTOLOAD`` and ``ELASTIC_PLUGINS`` do not apply to them, on
purpose. Those variables choose which *installed* hook plugins load, and an installed one
loads on every run unless they leave it out. These load on no run by being installed:
only when the run's own flag asks for one (below), and switching one off is leaving out
that flag. Leaving one out because of the variables would make an explicit
``--stall-timeout`` or ``--health-port`` silently do nothing (``tests/test_builtin_plugins.py``).

``watchdog`` (the shared ``WorkerWatch``) runs when any of the others does; ``stall``
with ``--stall-timeout``; ``file-timer`` with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``;
``health`` with ``--health-port`` (bound here: a port in use raises ``HealthPortError``
before anything starts).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from elastic.core.watchdog import file_timer

if TYPE_CHECKING:
    from elastic.core.interfaces.spec import WorkerSpec
    from elastic.core.plugin.host import PluginHost
    from elastic.core.workers.loop_clock import LoopClock


def register_builtins(
    host: PluginHost,
    spec: WorkerSpec,
    environ: Mapping[str, str] | None = None,
    clock: LoopClock | None = None,
) -> list[str]:
    """Register the built-ins ``spec`` and the environment ask for; their names.
    ``clock``: the agent loop's pulse, for liveness (without it ``/healthz`` only says
    that the process runs)."""
    env = os.environ if environ is None else environ
    timer_on = env.get(file_timer.ENV_ENABLE) == "1"
    if not (spec.stall_timeout or spec.health_port is not None or timer_on):
        return []
    # Imported only for a run that asks for one (most do not): ~4 ms of an agent's start.
    from elastic.core.watchdog.file_timer_plugin import FileTimerWatch
    from elastic.core.watchdog.health import HealthEndpoint, liveness_bound
    from elastic.core.watchdog.stall import StallDetector
    from elastic.core.watchdog.watch import WorkerWatch

    watch = WorkerWatch(
        timeout=spec.stall_timeout,
        dumps=bool(spec.stall_timeout or timer_on),
        pythonpath=spec.extra_env.get("PYTHONPATH", env.get("PYTHONPATH")),
    )
    plugins: list[tuple[str, object]] = [("watchdog", watch)]
    if spec.health_port is not None:  # first: a port in use must fail before anything runs
        bound = liveness_bound(spec, env)
        plugins.append(("health", HealthEndpoint(watch, spec.health_port, clock, bound)))
    if spec.stall_timeout:
        plugins.append(("stall", StallDetector(watch, spec.stall_timeout)))
    if timer_on:
        plugins.append(("file-timer", FileTimerWatch(watch, env.get(file_timer.ENV_FILE))))
    for name, plugin in plugins:
        host.register(plugin, name)
    return [name for name, _ in plugins]
