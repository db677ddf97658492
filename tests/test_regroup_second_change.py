"""A second change while the job regroups in place (issue 34, item 5), on a simulated
multi-host network: real agents (c10d, the store on host 0), one per host, running
``elastic.harness.regroup_job.REGROUP_WORKER`` (``elastic.train`` on gloo, no checkpointer,
an integer state that ends bit-identical to an unbroken run's).

A node joins a 3-node job; while the round with it has formed and the kept workers wait for
the joiner's new worker to get ready, a kept node dies (SIGKILL of its host). The job goes
on to the next round, and the two other kept nodes' workers keep their processes: they
are told the newer round and re-form again, never restarted by their agents (which once
waited out their bounds and restarted every worker, losing the in-place state); that
round is theirs alone (``records.kept_first``), so they train in it while the joiner's
worker still starts, and the joiner's worker takes the round after as it creates its
group instead of being restarted. When the kept node is cut off instead, the others'
workers, blocked in a collective with it, are freed as soon as it is found gone, not once
the joiner is ready."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
from elastic.harness.cluster import Cluster
from elastic.harness.multihost import wait_until
from elastic.harness.regroup_job import (
    JOIN_STEPS,
    REJOIN_STEPS,
    all_done,
    finish,
    hurry_once,
    reference_run,
    start_job,
    workers_kept,
)

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]


@pytest.mark.timeout(300)
def test_a_member_dying_while_a_joiner_gets_ready_keeps_the_other_workers(
    cluster_factory: Make, tmp_path
) -> None:
    with reference_run(tmp_path, REJOIN_STEPS) as expected:
        cluster = cluster_factory(4)
        nodes = list(cluster.hosts)
        kept, victim, joiner = nodes[:2], nodes[2], nodes[3]
        job = start_job(cluster, tmp_path, "2:4", nodes[:3], REJOIN_STEPS)
        # The joiner's worker is still starting when the kill comes (a big model).
        (job.workdir / f"slow-start-{joiner.name}").write_text("4")
        job.start(joiner)
        with_joiner = re.compile(r"round \d+ formed: 4 nodes")
        formed = wait_until(lambda: with_joiner.search(job.nodes[kept[0].name].text()), 60)
        assert formed, job.texts()
        killed = time.time()
        victim.kill()  # while the kept workers wait for the joiner's to get ready
        hurry_once(job, [*kept, joiner], 3, killed)
        finish(job, [*kept, joiner])
        value = expected()
    seen = workers_kept(job, kept, killed)
    # The joiner's worker is not restarted either: it takes the next round as it
    # creates its group, so its start-up is not thrown away.
    started = sorted(p.name for p in job.workdir.glob(f"slow-started-{joiner.name}-*"))
    assert len(started) == 1, f"the joiner's worker started again: {started}\n{job.texts()}"
    steps_after = [e for e in seen if e["event"] == "step" and e["world"] == 3 and e["t"] > killed]
    assert {e["host"] for e in steps_after} == {h.name for h in (*kept, joiner)}, steps_after
    # Until then the kept workers trained on their own: the joiner's start-up (4 s) did
    # not hold them.
    first = min(e["t"] for e in steps_after)
    steps = [e for e in seen if e["event"] == "step" and e["world"] == 2]
    alone = [e for e in steps if killed < e["t"] < first]
    assert {e["host"] for e in alone} == {h.name for h in kept}, f"{alone}\n{job.texts()}"
    all_done(seen, 3, value)
    print(
        f"a death during the join: {len(alone) // 2} steps in the 2-node world, then the "
        f"first step of the 3-node world {first - killed:.2f}s after the kill"
    )


@pytest.mark.timeout(300)
def test_a_second_joiner_while_the_first_gets_ready_keeps_the_workers(
    cluster_factory: Make, tmp_path
) -> None:
    """A node joins a 2-node job; while the kept workers wait for its new worker to get
    ready, another node joins. The first joiner's agent goes on to the round with the
    second (its new worker cannot regroup yet); the kept nodes must follow at once, not
    wait out their ready bound in a round nobody will complete and miss the next one."""
    with reference_run(tmp_path, JOIN_STEPS) as expected:
        cluster = cluster_factory(4)
        nodes = list(cluster.hosts)
        kept = nodes[:2]
        job = start_job(cluster, tmp_path, "2:4", kept, JOIN_STEPS)
        job.start(nodes[2])
        with_first = re.compile(r"round \d+ formed: 3 nodes")
        formed = wait_until(lambda: with_first.search(job.nodes[kept[0].name].text()), 60)
        assert formed, job.texts()
        second = time.time()
        job.start(nodes[3])
        hurry_once(job, nodes, 4, second)
        finish(job, nodes)
        value = expected()
    seen = workers_kept(job, kept, second)
    # one world at a time: the joiners never trained without the kept workers
    worlds = {e["world"] for e in seen if e["event"] == "step"}
    assert worlds <= {2, 3, 4} and 4 in worlds, worlds
    for host in nodes[2:]:
        alone = [e for e in seen if e["host"] == host.name and e["event"] == "step"]
        assert all(e["world"] >= 3 for e in alone), alone
    all_done(seen, 4, value)
    first = min(e["t"] for e in seen if e["event"] == "step" and e["world"] == 4)
    print(f"a second joiner: first step of the 4-node world {first - second:.2f}s after it started")


@pytest.mark.timeout(300)
def test_a_member_cut_off_while_a_joiner_gets_ready_frees_the_kept_workers_at_once(
    cluster_factory: Make, tmp_path
) -> None:
    """The cut-off node's peers wait for it in a collective (no connection closes). Found
    gone while the round with the joiner is readied, it makes that round superseded; the
    kept workers give their wait up then, while the joiner's worker still sleeps, rather
    than after it got ready and the next round was handed over (2 s later still)."""
    cluster = cluster_factory(4)
    nodes = list(cluster.hosts)
    kept, victim, joiner = nodes[:2], nodes[2], nodes[3]
    job = start_job(cluster, tmp_path, "2:4", nodes[:3], JOIN_STEPS)
    (job.workdir / f"slow-start-{joiner.name}").write_text(str(JOINER_SLEEPS))
    job.start(joiner)
    with_joiner = re.compile(r"round \d+ formed: 4 nodes")
    formed = wait_until(lambda: with_joiner.search(job.nodes[kept[0].name].text()), 60)
    assert formed, job.texts()
    cut = time.time()
    cluster.cut(victim)  # the kept workers train on in the old group, with the victim
    freed = "rolled back, waiting for the job to re-form"

    def freed_or_joiner_up() -> bool:
        return freed in job.nodes[kept[0].name].text() or job.latest(joiner) is not None

    assert wait_until(freed_or_joiner_up, 60), job.texts()
    gone_after = time.time() - cut
    assert job.latest(joiner) is None, (
        f"the kept workers waited for the joiner's worker (up {gone_after:.1f}s after the "
        f"cut) before they gave up the cut-off peer\n{job.texts()}"
    )
    hurry_once(job, [*kept, joiner], 3, cut)
    finish(job, [*kept, joiner])
    seen = workers_kept(job, kept, cut)
    # The kept nodes train in a round of their own while the joiner's worker sleeps
    # (``records.kept_first``), and may finish the job before it is up.
    assert {e["world"] for e in seen if e["event"] == "done"} <= {2, 3}, job.texts()
    alone = [e for e in seen if e["event"] == "step" and e["world"] == 2 and e["t"] > cut]
    assert {e["host"] for e in alone} == {h.name for h in kept}, job.texts()
    print(f"a cut during the join: kept workers freed {gone_after:.2f}s after it")


JOINER_SLEEPS = 12  # s the joiner's worker sleeps before import torch: past the detection
