"""Fixtures shared by every test module: a free port, processes killed at teardown, the
simulated cluster. The helpers the modules import are in ``elastic.harness`` (commands,
processes, distributions, worker specs, store sockets) and ``elastic.testing`` (ports,
waits), shared with the bench scripts."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from elastic.core.rendezvous.round.presence import PresenceServer
from elastic.harness.cluster import cluster_factory  # noqa: F401  (the fixture, for every test)
from elastic.harness.processes import Processes
from elastic.testing.ports import free_port

# Under srun, ``elastic run`` takes the step's nodes from SLURM_* (cli/slurm.py): a suite run
# inside a SLURM job must not turn every test's launch into a job across the allocation.
# Tests that want a SLURM environment give it explicitly.
for _name in [n for n in os.environ if n.startswith("SLURM_")]:
    del os.environ[_name]


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def presence_server() -> Iterator[PresenceServer]:
    """A presence port of run "job" (no token) watching member "m1" of round 1."""
    server = PresenceServer("127.0.0.1", None, "job")
    server.watch(["m1"], 1)
    yield server
    server.close()


@pytest.fixture
def procs() -> Iterator[Processes]:
    p = Processes()
    yield p
    p.cleanup()
