"""The built-in error-reporting plugin (entry point ``errors`` in ``elastic.plugins``).

It registers exactly as a third-party plugin would: the entry point is the class, so
each agent gets its own ``ErrorsPlugin``. It owns ``--error-summary PATH``. Per worker
failure it logs one line; when the run fails for good it prints the job-wide summary on
stderr and, with ``--error-summary``, writes the same as JSON. ``elastic_run_failed``
is a strict hook, so a summary that cannot be written fails loudly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from elastic.core.log import say
from elastic.core.plugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from elastic.core.interfaces.failures import FailureRecord, FailureSummary
    from elastic.core.interfaces.spec import WorkerSpec
    from elastic.core.plugin.config import ElasticConfig
    from elastic.core.plugin.options import PluginOptionParser

log = logging.getLogger("elastic.errors")


class ErrorsPlugin:
    """Worker failures as one log line each; the run's failure as a summary."""

    def __init__(self) -> None:
        self.summary_path: str | None = None

    @hookimpl
    def elastic_addoption(self, parser: PluginOptionParser) -> None:
        parser.addoption(
            "--error-summary",
            metavar="PATH",
            help="Write the failure summary as JSON to this path.",
        )

    @hookimpl
    def elastic_agent_start(self, spec: WorkerSpec, config: ElasticConfig) -> None:
        self.summary_path = config.option("error_summary")

    @hookimpl
    def elastic_worker_failed(self, record: FailureRecord) -> None:
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
    def elastic_run_failed(self, summary: FailureSummary) -> None:
        from elastic.plugins.errors.summary import render_summary, write_summary_json

        say(render_summary(summary), logging.ERROR)
        if self.summary_path:
            write_summary_json(self.summary_path, summary)
            say(f"elastic: error summary written to {self.summary_path}")
