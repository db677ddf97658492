"""The ``acme-report`` hook plugin: ``--acme-report PATH`` writes a JSON summary of the
run (rounds, world sizes, failures, how it ended) for Acme's job page.

The entry point names the class, so elastic creates one ``AcmeReport`` per agent and the
run's state lives on it. Workers get ``ACME_JOB_ID`` so they can tag what they log.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

from elastic import hookimpl

if TYPE_CHECKING:
    from elastic import ElasticConfig, RunResult, WorkerSpec
    from elastic.core.failures import FailureRecord
    from elastic.core.plugin_options import PluginOptionParser
    from elastic.core.rendezvous import RendezvousInfo


class AcmeReport:
    def __init__(self) -> None:
        self.path: str | None = None
        self.run_id = ""
        self.rounds: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []

    @hookimpl
    def elastic_addoption(self, parser: PluginOptionParser) -> None:
        parser.addoption(
            "--acme-report",
            metavar="PATH",
            help="Write a JSON summary of the run to PATH (for Acme's job page).",
        )

    @hookimpl
    def elastic_agent_start(self, spec: WorkerSpec, config: ElasticConfig) -> None:
        self.path = config.option("acme_report")
        self.run_id = config.run_id

    @hookimpl
    def elastic_worker_env(self, config: ElasticConfig) -> dict[str, str]:
        return {"ACME_JOB_ID": config.run_id}

    @hookimpl
    def elastic_rendezvous_complete(self, info: RendezvousInfo, duration: float) -> None:
        self.rounds.append({"round": info.round, "rank": info.rank, "world_size": info.world_size})

    @hookimpl
    def elastic_worker_failed(self, record: FailureRecord) -> None:
        self.failures.append({"rank": record.rank, "exit_code": record.exit_code})

    @hookimpl(trylast=True)  # after every other plugin has seen the end of the run
    def elastic_run_end(self, result: RunResult, duration: float) -> None:
        if not self.path:
            return
        report = {
            "run_id": self.run_id,
            "state": result.state.value,
            "exit_code": result.exit_code,
            "seconds": round(duration, 3),
            "rounds": self.rounds,
            "failures": self.failures,
        }
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".acme-report.")
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, self.path)  # Acme's page never reads half a report
