"""pytest fixtures for people who write elastic plugins (entry point ``pytest11: elastic``).

Installed with elastic-launch, so any test suite gets them without configuration:

- ``elastic_agent_runner``: an ``AgentRunner`` (``elastic.testing.agent_runner``) that
  runs a real standalone agent with the hook plugins you choose and records every hook
  call, its arguments and the order pluggy called the plugins in;
- ``elastic_conformance``: ``run_conformance(target, cases=None)``
  (``elastic.testing.conformance_runner``), the backend conformance suite against your
  rendezvous backend from one test; ``ConformanceReport.assert_passed()`` fails it with
  every failing case named. (Or subclass ``RendezvousConformance`` for a test per case.)

Importing this module imports nothing but pytest: every pytest run in an environment
with elastic installed loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from elastic.testing.agent_runner import AgentRunner
    from elastic.testing.conformance_runner import ConformanceReport


@pytest.fixture
def elastic_agent_runner(tmp_path: Path) -> Iterator[AgentRunner]:
    """Runs standalone agents with chosen plugins; log directories under ``tmp_path``."""
    from elastic.testing.agent_runner import AgentRunner

    yield AgentRunner(tmp_path / "elastic-runs")


@pytest.fixture
def elastic_conformance() -> Callable[..., ConformanceReport]:
    """``elastic_conformance(RendezvousTarget(...), cases=None) -> ConformanceReport``."""
    from elastic.testing.conformance_runner import run_conformance

    def run(*args: Any, **kwargs: Any) -> ConformanceReport:
        return run_conformance(*args, **kwargs)

    return run
