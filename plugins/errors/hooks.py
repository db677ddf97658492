"""The built-in error-reporting plugin (entry point ``errors`` in ``elastic.plugins``).

It registers exactly as a third-party plugin would. Per worker failure it logs one line;
when the run fails for good it prints the job-wide summary on stderr and, with
``--error-summary PATH``, writes the same as JSON. ``elastic_run_failed`` is called
strictly by the agent, so a summary that cannot be written fails loudly.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from elastic.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from elastic.core.failures import FailureRecord, FailureSummary
    from elastic.core.spec import WorkerSpec

log = logging.getLogger("elastic.errors")

# Per-process settings captured at agent start. A module is the plugin object, so state
# lives here; ``elastic_agent_start`` resets it for each agent.
_settings: dict[str, object] = {}


@hookimpl
def elastic_agent_start(spec: WorkerSpec, settings: dict[str, object]) -> None:
    _settings.clear()
    _settings["error_summary"] = settings.get("error_summary") or None
    _settings["role"] = spec.role


@hookimpl
def elastic_worker_failed(record: FailureRecord) -> None:
    from elastic.plugins.errors.summary import describe_exit

    first_line = record.message.strip().splitlines()[0] if record.message.strip() else ""
    log.warning(
        "worker failed: rank %s (local rank %s) on %s, pid %s, %s%s",
        record.rank,
        record.local_rank,
        record.host,
        record.pid,
        describe_exit(record),
        f": {first_line}" if first_line else "",
    )


@hookimpl
def elastic_run_failed(summary: FailureSummary) -> None:
    from elastic.plugins.errors.summary import render_summary, write_summary_json

    print(render_summary(summary), file=sys.stderr, flush=True)
    path = _settings.get("error_summary")
    if path:
        write_summary_json(str(path), summary)
        print(f"elastic: error summary written to {path}", file=sys.stderr, flush=True)
