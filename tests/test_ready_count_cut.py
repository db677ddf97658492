"""A joining node cut off while its new worker gets ready (the fault campaign,
``bench/campaign.py --impls c10d --seeds 4``), on a simulated multi-host network: real
agents (c10d, the store on host 0), one per host, running
``elastic.harness.regroup_job.REGROUP_WORKER``.

The joiner's worker reaches ``elastic.init_process_group`` while the joiner's cable is
out, so its agent's count of readiness for the round goes unanswered. That is a partition,
like any store call on the agent's decision paths: the agent stops its workers and rejoins
once the network is back (the round's liveness is 30 s here, so the fencing itself comes
late). It once took the unanswered count for a store gone, exited 1 ("lost the rendezvous
backend") and ended with a code that was not the job's outcome."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
from elastic.harness.cluster import Cluster
from elastic.harness.multihost import wait_until
from elastic.harness.preemption_job import last_step, read_events
from elastic.harness.regroup_job import (
    CHANGE_AT,
    FORM_TIMEOUT,
    PAUSE,
    finish,
    hurry_once,
    reference_run,
    regroup_job,
)

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]
# 60 s at PAUSE: the job outlasts the cut, the heal and the rejoin (18 s here, over 30 s
# with one core taken by a busy loop); once the three nodes step again it hurries.
STEPS = 600
# What the joiner's agent says when its count of readiness went unanswered, and how long
# after its worker's start record the test waits for it, the cable out.
UNANSWERED = "cannot reach the rendezvous store"
CUT_MAX = 60.0


@pytest.mark.timeout(300)
def test_a_joiner_cut_off_while_its_worker_gets_ready_rejoins(
    cluster_factory: Make, tmp_path
) -> None:
    with reference_run(tmp_path, STEPS) as expected:
        cluster = cluster_factory(3)
        nodes = list(cluster.hosts)
        running, joiner = nodes[:2], nodes[2]
        job = regroup_job(
            cluster, tmp_path, steps=STEPS, pause=PAUSE, nnodes="2:3", args=["--max-restarts=0"]
        )
        job.conf["heartbeat_timeout"] = 30
        assert job.start_together(running, FORM_TIMEOUT), job.texts()
        # the workers train (elastic.train said they can regroup) before the joiner comes
        trained = wait_until(lambda: last_step(read_events(job.workdir), 2) >= CHANGE_AT, 60)
        assert trained, job.texts()
        job.start(joiner)
        formed = re.compile(r"round \d+ formed: 3 nodes")
        assert wait_until(lambda: formed.search(job.nodes[joiner.name].text()), 60), job.texts()
        cluster.cut(joiner)  # its worker has just started: it gets ready while cut off
        # The start record comes after import torch, just before the worker says it is
        # ready. A machine loaded enough to hold the import past the agent's read timeout
        # (10 s) meets the same partition a step earlier: another store call of the agent
        # goes unanswered first, and it must end the same way (stop, rejoin, finish).
        started = wait_until(
            lambda: job.latest(joiner) is not None or UNANSWERED in job.nodes[joiner.name].text(),
            60,
        )
        assert started, job.texts()
        # The cable stays out until the count went unanswered (its read gives up after
        # 10 s): a loaded machine gets the worker ready later, and a cut healed first
        # would let the count through.
        unanswered = wait_until(lambda: UNANSWERED in job.nodes[joiner.name].text(), CUT_MAX)
        assert unanswered, job.texts()
        healed = time.time()
        cluster.heal(joiner)
        hurry_once(job, nodes, 3, healed)
        finish(job, nodes)
        value = expected()
    text = job.nodes[joiner.name].text()
    assert "lost the rendezvous backend" not in text, job.texts()
    seen = read_events(job.workdir)
    done = [e for e in seen if e["event"] == "done"]
    assert len(done) == 3 and {e["value"] for e in done} == {value}, (done, job.texts())
