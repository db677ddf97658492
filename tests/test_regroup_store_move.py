"""The c10d store's holder leaves while the job regroups in place (the fault campaign,
``bench/campaign.py --impls c10d --seeds 2``), on a simulated multi-host network: real
agents (c10d, the store on host 0), one per host, running
``elastic.harness.regroup_job.REGROUP_WORKER`` (``elastic.train`` on gloo, no checkpointer,
an integer state that ends bit-identical to an unbroken run's).

A node joins a 3-node job; while the round with it has formed and the kept workers wait
for the joiner's new worker to get ready, the node holding the store is preempted
(SIGTERM): it hands the store over and leaves. The kept nodes' count of readiness is in
flight at that moment ("the store moved ... during a ADD, whose outcome is unknown"); they
must go on to the next round where the store is now with the same workers, which once
stopped every worker there and lost the in-place state."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import pytest
from elastic.harness.cluster import Cluster
from elastic.harness.multihost import wait_until
from elastic.harness.regroup_job import (
    JOIN_STEPS,
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
def test_the_store_holder_leaving_while_a_joiner_gets_ready_keeps_the_workers(
    cluster_factory: Make, tmp_path
) -> None:
    with reference_run(tmp_path, JOIN_STEPS) as expected:
        cluster = cluster_factory(4)
        nodes = list(cluster.hosts)
        holder, kept, joiner = nodes[0], nodes[1:3], nodes[3]
        job = start_job(cluster, tmp_path, "2:4", nodes[:3], JOIN_STEPS)
        job.start(joiner)
        with_joiner = re.compile(r"round \d+ formed: 4 nodes")
        formed = wait_until(lambda: with_joiner.search(job.nodes[kept[0].name].text()), 60)
        assert formed, job.texts()
        left = time.time()
        os.kill(job.nodes[holder.name].proc.pid, signal.SIGTERM)  # while they get ready
        assert job.nodes[holder.name].wait(60) == 128 + signal.SIGTERM, job.texts()
        hurry_once(job, [*kept, joiner], 3, left)
        finish(job, [*kept, joiner])
        value = expected()
    texts = job.texts()
    assert "handed the c10d rendezvous store over" in texts, texts
    names = {h.name for h in kept}
    seen = workers_kept(job, kept, left)
    all_done(seen, 3, value, texts)
    # The new world: from the joiner's first sync (the old one, the holder in it, may
    # finish a step in flight after the signal).
    synced = min(e["t"] for e in seen if e["host"] == joiner.name and e["event"] == "sync")
    steps_after = [e for e in seen if e["event"] == "step" and e["world"] == 3 and e["t"] > synced]
    assert {e["host"] for e in steps_after} == {*names, joiner.name}, steps_after
    first = min(e["t"] for e in steps_after)
    print(f"the holder left during the join: first 3-node step {first - left:.2f}s after")
