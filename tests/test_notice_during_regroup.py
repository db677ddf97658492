"""A preemption notice that lands while the job regroups in place (issue 34: a fault
during a fault), on a simulated multi-host network: real agents (c10d, the store on host
0), one per host, running ``elastic.harness.regroup_job.REGROUP_WORKER`` (``elastic.train``
on gloo, no checkpointer: the state lives only in the workers).

A node joins a 2-node job with a worker slow to start; while the round with it is readied,
the other old node dies, so the kept node's workers hold the only copy of the state and
wait, with no group, for the joiner's worker to get ready. Then the kept node gets its
notice (SIGTERM). No group can save on request before the new one forms: the notice waits
(half the grace at most) until the kept workers took the new round, so the joiner's
worker syncs the state from them, the job saves, and the node leaves. Acted on at once,
the notice waited out its whole grace (25 s) for a save that could not come, and took
the only copy of the state away with it: the joiner's worker started over from step 0."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import pytest
from elastic.harness.cluster import Cluster
from elastic.harness.multihost import wait_until
from elastic.harness.preemption_job import read_events
from elastic.harness.regroup_job import JOIN_STEPS, finish, hurry_once, reference_run, start_job

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]
JOINER_SLEEPS = 6  # s the joiner's worker sleeps before it imports torch


@pytest.mark.timeout(300)
def test_a_notice_while_the_job_regroups_waits_for_the_group_and_keeps_the_state(
    cluster_factory: Make, tmp_path
) -> None:
    with reference_run(tmp_path, JOIN_STEPS) as expected:
        cluster = cluster_factory(3)
        kept, victim, joiner = cluster.hosts
        job = start_job(cluster, tmp_path, "1:3", [kept, victim], JOIN_STEPS)
        (job.workdir / f"slow-start-{joiner.name}").write_text(str(JOINER_SLEEPS))
        job.start(joiner)
        with_joiner = re.compile(r"round \d+ formed: 3 nodes")
        formed = wait_until(lambda: with_joiner.search(job.nodes[kept.name].text()), 60)
        assert formed, job.texts()
        before = len(job.nodes[kept.name].text())
        victim.kill()  # the kept node's old group breaks: its workers wait, no group
        # It found the death, and the round with the joiner formed: its workers wait for
        # the joiner's, still starting (JOINER_SLEEPS). A fixed pause here raced a loaded
        # machine, where the notice could land before that round (the kept node alone).
        with_both = re.compile(r"round \d+ formed: 2 nodes")
        regrouped = wait_until(lambda: with_both.search(job.nodes[kept.name].text()[before:]), 30)
        assert regrouped, job.texts()
        noticed = time.time()
        os.kill(job.nodes[kept.name].proc.pid, signal.SIGTERM)
        code = job.nodes[kept.name].wait(timeout=60)
        left = time.time() - noticed
        assert code == 128 + signal.SIGTERM, job.texts()
        hurry_once(job, [joiner], 1, noticed)
        finish(job, [joiner])
        value = expected()
    texts = job.texts()
    assert "the job's checkpoint is complete; leaving" in texts, texts
    assert left < 20, f"the kept node left {left:.1f}s after its notice\n{texts}"
    seen = read_events(job.workdir)
    theirs = [e for e in seen if e["host"] == joiner.name]
    synced = [e for e in theirs if e["event"] == "sync"]
    assert synced and synced[0]["step"] > 0, f"the joiner started over: {synced}\n{texts}"
    starts = {e["pid"] for e in theirs}
    assert len(starts) == 1, f"the joiner's worker was restarted: {starts}"
    done = [e for e in theirs if e["event"] == "done"]
    assert [e["value"] for e in done] == [value], done
    print(f"a notice during a regroup: the node left {left:.2f}s after it, the state kept")
