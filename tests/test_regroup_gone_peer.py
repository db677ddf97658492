"""A peer gone without closing its connections never holds the kept workers in gloo past
the agent's bound (issue 34), on a simulated multi-host network: real agents (c10d, the
store on host 0), one per host, running ``elastic.harness.regroup_job.REGROUP_WORKER``
(``elastic.train`` on gloo with a 60 s collective timeout, no checkpointer, an integer
state that ends bit-identical to an unbroken run's).

Host 2's worker sleeps after its step's all_reduce, so the two other workers wait for it
in the step agreement; then host 2's cable is cut. No FIN reaches them: gloo would hold
them there for its whole timeout, past the bound within which their agents, having
re-formed the job without host 2, want them to take the new round, and the agents would
restart them (new processes, the state kept in place lost). They give up the agreement
once the new round is handed over, roll the step back and re-form in the same processes.

Host 2's worker sleeps before its step's all_reduce instead: the others wait in the
script's own collective, which only cutting their group's sockets ends (``sever``).

A node joins; its new worker says it is ready to join the round's group, then its host
dies before it connects. The kept workers, taking that round, would wait in gloo's
creation of the group (rank 0's store waiting for every rank, the full-mesh connect) for
the whole timeout; they meet in Python first, and go on to the round without it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic.harness.cluster import Cluster
from elastic.harness.multihost import wait_until
from elastic.harness.regroup_job import (
    JOIN_STEPS,
    PAUSE,
    all_done,
    finish,
    hurry_once,
    reference_run,
    start_job,
    workers_kept,
)

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("marker", "where"),
    [
        # it sleeps after its step's all_reduce: the others wait in the step agreement
        ("late", "the step agreement"),
        # it sleeps before it: the others wait in the script's own collective, which only
        # cutting their group's connections ends (``training/sever.py``)
        ("stall", "the script's own collective"),
    ],
    ids=["step-agreement", "own-collective"],
)
def test_a_peer_cut_off_while_the_others_wait_for_it_leaves_them_kept(
    cluster_factory: Make, tmp_path: Path, marker: str, where: str
) -> None:
    with reference_run(tmp_path) as expected:
        cluster = cluster_factory(3)
        nodes = list(cluster.hosts)
        job = start_job(cluster, tmp_path, "2:3", nodes)
        victim, survivors = nodes[2], nodes[:2]
        mark = job.workdir / f"{marker}-{victim.name}"
        mark.touch()
        assert wait_until(lambda: not mark.exists(), 30), job.texts()
        time.sleep(3 * PAUSE)  # the others reached the wait
        cut = time.time()
        cluster.cut(victim)
        hurry_once(job, survivors, 2, cut)
        finish(job, survivors)
        value = expected()
    seen = workers_kept(job, survivors, cut)
    after = [e for e in seen if e["event"] == "step" and e["world"] == 2 and e["t"] > cut]
    assert {e["host"] for e in after} == {h.name for h in survivors}, after
    all_done(seen, 2, value)
    first = min(e["t"] for e in after)
    print(f"a peer cut off in {where}: first 2-rank step {first - cut:.2f}s after")


@pytest.mark.timeout(240)
def test_a_joiner_gone_before_it_connects_leaves_the_others_kept(
    cluster_factory: Make, tmp_path: Path
) -> None:
    with reference_run(tmp_path, JOIN_STEPS) as expected:
        cluster = cluster_factory(4)
        nodes = list(cluster.hosts)
        kept, joiner = nodes[:3], nodes[3]
        job = start_job(cluster, tmp_path, "2:4", kept, JOIN_STEPS)
        (job.workdir / f"gone-before-connect-{joiner.name}").touch()
        job.start(joiner)
        ready = job.workdir / f"ready-{joiner.name}"
        assert wait_until(ready.exists, 90), job.texts()
        time.sleep(2.0)  # the kept workers took the 4-node round: in its creation now
        killed = time.time()
        joiner.kill()
        hurry_once(job, kept, 3, killed)
        finish(job, kept)
        value = expected()
    seen = workers_kept(job, kept, killed)
    after = [e for e in seen if e["event"] == "step" and e["t"] > killed]
    assert {e["world"] for e in after} == {3}, after
    all_done(seen, 3, value)
    first = min(e["t"] for e in after)
    print(f"a joiner gone before it connects: first 3-rank step {first - killed:.2f}s after")
