"""Preemption on a simulated multi-host network (issue 15): real agents (``python -m elastic
run``, c10d, the store on host 0) one per host of a ``cluster_factory`` cluster, each host
with its own address and name, running ``elastic.harness.multihost.PREEMPT_WORKER``: a gloo
DDP job on CPU with no periodic checkpoint, which asks ``elastic.checkpoint_requested()``
every step, agrees with one all_reduce MAX, saves, barriers and calls
``elastic.checkpoint_saved()``, as the README shows.

- SIGTERM to one node's agent (not the store's host) of a ``--nnodes=2:3`` job: every rank
  saves at one step, the agent leaves as soon as the save is complete (long before the
  grace), the survivors resume from that step (at most one step redone) without spending a
  restart (``--max-restarts=0``; ``TORCHELASTIC_RESTART_COUNT`` stays 0) and finish with
  the weights of an uninterrupted run.
- SIGTERM to two of three agents at once (``--nnodes=1:3``): one save, not two; the last
  node resumes from it.

The loopback variants are in ``tests/test_preemption.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic.harness.cluster import Cluster, Host
from elastic.harness.multihost import FaultJob, wait_until
from elastic.harness.preemption_job import (
    PREEMPT_WORKER,
    hurry_once,
    last_step,
    preempt_job,
    read_events,
)

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]

STEPS = 30  # the job's length; the notice comes after PREEMPT_AT steps of the 3-node job
PREEMPT_AT = 5
PAUSE = 0.1  # s per step, on top of the step itself
GRACE = 20.0  # --preemption-grace: leaving well before it shows the save released the node
LEAVE_LIMIT = 10.0  # s from the notice to the preempted agent's exit
# s from the notice to the survivors' new workers' first statement (before torch is
# imported): the save, the departure and one round; "the save's own time + about 1 s"
# (docs/architecture.md) with a loaded 2-core machine's margin
REGROUP_LIMIT = 10.0
FORM_TIMEOUT = 60.0  # first round: every agent imports and connects on 2 cores


def start_job(cluster: Cluster, workdir: Path, nnodes: str) -> tuple[FaultJob, list[Host]]:
    """The job on every host of ``cluster``, once it runs as one round of all of them."""
    nodes = list(cluster.hosts)
    job = preempt_job(
        cluster,
        workdir,
        steps=STEPS,
        every=0,
        pause=PAUSE,
        nnodes=nnodes,
        args=["--max-restarts=0", f"--preemption-grace={GRACE:g}"],
    )
    formed = job.start_together(nodes, FORM_TIMEOUT)
    assert formed, f"the {len(nodes)}-node job did not form\n{job.texts()}"
    world = len(nodes)
    trained = wait_until(lambda: last_step(read_events(job.workdir), world) >= PREEMPT_AT, 60)
    assert trained, f"the {world}-node job did not train\n{job.texts()}"
    return job, nodes


def preempt(job: FaultJob, victims: list[Host]) -> float:
    """SIGTERM every victim's agent at the same moment; each must leave within
    ``LEAVE_LIMIT`` s, saying the job's checkpoint is complete. Returns the signal's time."""
    signalled = time.time()
    for host in victims:
        os.kill(job.nodes[host.name].proc.pid, signal.SIGTERM)
    for host in victims:
        node = job.nodes[host.name]
        code = node.wait(timeout=GRACE + 20)
        took = time.time() - signalled
        # 128 + SIGTERM, as for any departure (docs/architecture.md, fault model).
        assert code == 128 + signal.SIGTERM, f"{host.name} exited {code}\n{job.texts()}"
        assert took < LEAVE_LIMIT, f"{host.name} left {took:.2f}s after the notice\n{node.text()}"
        assert "the job's checkpoint is complete; leaving" in node.text(), node.text()
    return signalled


def finish(job: FaultJob, survivors: list[Host]) -> None:
    for host in survivors:
        code = job.nodes[host.name].wait(timeout=90)
        assert code == 0, f"{host.name} exited {code}\n{job.texts()}"


def one_save_then_resume(
    job: FaultJob, signalled: float, world: int, survivors: list[Host]
) -> tuple[int, float, float]:
    """Every rank of the ``world``-rank job saved once, at one step; the survivors resumed
    from it with at most one step redone and no restart spent, their new workers starting
    within ``REGROUP_LIMIT`` s. Returns (that step, seconds from the notice to the
    survivors' new workers, and to their first step)."""
    seen = read_events(job.workdir)
    saved = [e for e in seen if e["event"] == "saved"]
    assert len({e["step"] for e in saved}) == 1, f"saves at several steps: {saved}"
    assert sorted(e["rank"] for e in saved) == list(range(world)), f"not one save per rank: {saved}"
    step = saved[0]["step"]
    assert saved[0]["t"] > signalled and saved[0]["why"] == "notice", saved
    redone = last_step(seen, world) - step
    assert 0 <= redone <= 1, f"{redone} steps redone (saved at {step})"
    new = len(survivors)
    resumed = [
        e for e in seen if e["event"] == "start" and e["world"] == new and e["t"] > signalled
    ]
    assert {e["host"] for e in resumed} == {h.name for h in survivors}, resumed
    assert {e["step"] for e in resumed} == {step}, f"resumed from {resumed}, saved at {step}"
    began = [r["t"] for r in job.starts() if r["world"] == new and r["t"] > signalled]
    regroup = max(began) - signalled
    assert regroup <= REGROUP_LIMIT, f"the survivors' workers started {regroup:.2f}s after"
    spent = {e["restart"] for e in seen} | {r["restart"] for r in job.starts()}
    assert spent == {0}, f"a preemption spent the restart budget: {spent}\n{job.texts()}"
    after = [
        e["t"] for e in seen if e["event"] == "step" and e["world"] == new and e["t"] > signalled
    ]
    assert after, f"the survivors never trained\n{job.texts()}"
    assert any(e["event"] == "done" and e["step"] == STEPS for e in seen), seen[-5:]
    return step, regroup, min(after) - signalled


@pytest.mark.timeout(150)
def test_a_preempted_node_checkpoints_the_job_and_the_survivors_resume(
    cluster_factory: Make, tmp_path: Path
) -> None:
    script = tmp_path / "reference.py"
    script.write_text(PREEMPT_WORKER)
    reference = subprocess.Popen(  # while the job forms: the weights of an unbroken run
        [sys.executable, str(script), "--reference", str(STEPS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        job, nodes = start_job(cluster_factory(3), tmp_path, "2:3")
        victim, survivors = nodes[2], nodes[:2]  # nodes[0] hosts the c10d store
        signalled = preempt(job, [victim])
        hurry_once(job.workdir, {h.name for h in survivors}, 2, signalled)
        finish(job, survivors)
        out, err = reference.communicate(timeout=60)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    step, regroup, resumed = one_save_then_resume(job, signalled, 3, survivors)
    assert reference.returncode == 0, err
    final = json.loads((tmp_path / "ckpt" / "final.json").read_text())
    assert final["step"] == STEPS and final["world"] == 2, final
    expected = json.loads(out)
    assert max(abs(a - b) for a, b in zip(final["weights"], expected, strict=True)) < 1e-4, (
        final["weights"],
        expected,
    )
    print(
        f"saved at step {step}; the survivors' workers started {regroup:.2f}s after the "
        f"notice and trained again after {resumed:.2f}s"
    )


@pytest.mark.timeout(150)
def test_two_notices_at_once_make_one_save(cluster_factory: Make, tmp_path: Path) -> None:
    job, nodes = start_job(cluster_factory(3), tmp_path, "1:3")
    survivor, victims = nodes[0], nodes[1:]  # the c10d store's host stays
    signalled = preempt(job, victims)
    for host in victims:
        notices = job.nodes[host.name].text().count("preemption notice")
        assert notices == 1, job.nodes[host.name].text()
    hurry_once(job.workdir, {survivor.name}, 1, signalled)
    finish(job, [survivor])
    step, regroup, resumed = one_save_then_resume(job, signalled, 3, [survivor])
    print(
        f"one save at step {step}; the last node's worker started {regroup:.2f}s after the "
        f"notices and trained again after {resumed:.2f}s"
    )
