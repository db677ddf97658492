"""The agent's in-place regroup when the workers' last step boundary was their last: ranks
that agreed training is done (``DONE`` in their control-file slot) are never taken for
workers stuck before the new round, even while they still tear the old group down. In
one process (the agent's functions against real processes) and on the simulated network
(a node joins as a 2-node job finishes and its workers are slow to exit)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from elastic.core.agent.regroup import BOUNDARY_WAIT, finished_untaken, wait_taken
from elastic.core.workers.control_file import (
    DONE,
    ENV_CONTROL,
    ENV_CONTROL_SLOT,
    ControlFile,
)
from elastic.harness.cluster import Cluster
from elastic.harness.multihost import wait_until
from elastic.harness.preemption_job import read_events
from elastic.harness.regroup_job import regroup_job
from elastic.harness.worker_specs import SleepingWorker
from elastic.training import control, preemption


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlFile]:
    """A 1-worker node's control file; this process writes local rank 0's slot."""
    file = ControlFile(1, directory=str(tmp_path))
    monkeypatch.setenv(ENV_CONTROL, file.path)
    monkeypatch.setenv(ENV_CONTROL_SLOT, "0")
    preemption._reset_for_tests()
    yield file
    preemption._reset_for_tests()
    file.close()


def test_a_done_worker_still_exiting_finished_in_the_old_round(node: ControlFile) -> None:
    # its ranks agreed the job is done; its exit (the old group's barrier) takes a while
    worker = SleepingWorker(seconds=1.5)
    try:
        control.set_mine(DONE, 1)
        generation = node.hand_over({0: {"RANK": "0"}})
        began = time.monotonic()
        assert wait_taken(node, generation, [worker], time.sleep)
        assert time.monotonic() - began < 1.0  # not the bound: it will never take the round
        assert finished_untaken(node, generation, [worker], time.sleep)
        assert worker.poll() == 0  # waited for, not left to be stopped
        assert time.monotonic() - began < BOUNDARY_WAIT
    finally:
        worker.proc.kill()
        worker.proc.wait()


def test_a_running_worker_that_is_not_done_has_not_finished(node: ControlFile) -> None:
    worker = SleepingWorker(seconds=30)
    try:
        generation = node.hand_over({0: {"RANK": "0"}})
        began = time.monotonic()
        assert not finished_untaken(node, generation, [worker], time.sleep)
        assert time.monotonic() - began < 1.0 and worker.poll() is None
    finally:
        worker.proc.kill()
        worker.proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_workers_done_at_the_regroup_boundary_are_not_restarted_however_slow_their_exit(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A third node joins a 2-node job whose last step is held until the regroup is asked
    for, so the ranks agree on "done" at the boundary meant to re-form the job; then each
    kept worker takes longer to exit than the agent's bound for taking a round. The agents
    must see the job finished: no worker started again, no step in a 3-rank world (a
    restarted worker would start at step 0 there), every agent exits 0."""
    steps = 15
    cluster = cluster_factory(3)
    nodes = list(cluster.hosts)
    job = regroup_job(
        cluster,
        tmp_path,
        steps=steps,
        pause=0.1,
        nnodes="2:3",
        args=["--max-restarts=3"],
        env={"REGROUP_HOLD_LAST": "1", "REGROUP_EXIT_DELAY": str(3 * BOUNDARY_WAIT)},
    )
    assert job.start_together(nodes[:2], 60.0), job.texts()
    held = lambda: any(e["step"] == steps - 1 for e in read_events(job.workdir))  # noqa: E731
    assert wait_until(held, 60), job.texts()
    job.start(nodes[2])
    for host in nodes:
        code = job.nodes[host.name].wait(timeout=120)
        assert code == 0, f"{host.name} exited {code}\n{job.texts()}"
    seen = read_events(job.workdir)
    done = [e for e in seen if e["event"] == "done"]
    assert len(done) == 2 and {e["step"] for e in done} == {steps}, done
    first_done = min(e["t"] for e in done)
    again = [r for r in job.starts() if r["t"] > first_done and r["host"] != nodes[2].name]
    assert not again, f"workers started again after the job finished: {again}\n{job.texts()}"
    assert not [e for e in seen if e["world"] == 3 and e["event"] == "step"], job.texts()
