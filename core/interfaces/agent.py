"""The agent interface (torch's ``ElasticAgent``): run one node's share of a job."""

from __future__ import annotations

import abc

from elastic.core.interfaces.spec import RunResult, WorkerGroup


class ElasticAgent(abc.ABC):
    """An agent runs one node's share of a job and reports how it ended."""

    @abc.abstractmethod
    def run(self) -> RunResult:
        """Run the workers to completion (restarting them as needed)."""

    @abc.abstractmethod
    def get_worker_group(self) -> WorkerGroup:
        """This node's current worker group (its state, ranks and round)."""
