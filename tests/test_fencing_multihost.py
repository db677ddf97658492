"""Fencing holds for the workers: a node cut off from the job has its worker processes
gone at least ``GAP`` s before any survivor's worker of the round that replaces it starts,
on every dynamic backend, however busy its agent's main loop is (issue 34, item 3).

Three simulated hosts (``cluster_factory``), default liveness (heartbeat 1 s, timeout
5 s), one worker per node; the victim's ignores SIGTERM (as one stuck in a collective
does: only SIGKILL ends it). On the victim, a hook plugin blocks the agent's main loop for 30 s in
``elastic_check_workers`` from just before the cut, so nothing but the rendezvous
handler's own threads can stop the workers in time. Worker exit is measured as process
exit (``ExitWatch``: gone or a zombie), on the hosts' shared clock with the survivors'
start records.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic.harness.cluster import Cluster, Host
from elastic.harness.distributions import make_distribution
from elastic.harness.multihost import START_RECORD, ExitWatch, FaultJob, serve_rendezvous
from elastic.testing.waits import wait_until

pytestmark = pytest.mark.slow

GAP = 0.5  # s: the cut-off node's workers gone at least this long before the new round
FORM_TIMEOUT = 90.0

WORKER = (
    """\
import json, os, signal, socket, sys, time
t0 = time.time()
"""
    + START_RECORD
    + """\


def on_sigterm(signum, frame):
    # On the host the test names (the victim's), stuck: only SIGKILL ends it.
    try:
        with open(os.environ["BLOCK_FILE"]) as f:
            stuck = f.read() == socket.gethostname()
    except OSError:
        stuck = False
    if not stuck:
        os._exit(128 + signum)


signal.signal(signal.SIGTERM, on_sigterm)
stop = os.path.join(out, "stop")
while not os.path.exists(stop):
    time.sleep(0.05)
"""
)

BLOCKER = """
import os, socket, time
from elastic import hookimpl

@hookimpl
def elastic_check_workers(workers):
    # The agent's main loop, held up on the host the test names in the file.
    try:
        with open(os.environ["BLOCK_FILE"]) as f:
            host = f.read()
    except OSError:
        return None
    if host == socket.gethostname():
        time.sleep(30)
    return None
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["c10d", "etcd-v2", "etcd-v3"])
def test_a_cut_off_node_s_workers_are_gone_before_the_new_round(
    cluster_factory: Callable[..., Cluster], tmp_path: Path, backend: str
) -> None:
    cluster = cluster_factory(3 if backend == "c10d" else 4)
    nodes, endpoint = serve_rendezvous(cluster, backend, tmp_path, 3)
    site = make_distribution(
        tmp_path / "site", "blocker", "[elastic.plugins]\nblocker = blocker\n", {"blocker": BLOCKER}
    )
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    block = tmp_path / "block"
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "BLOCK_FILE": str(block),
    }
    job = FaultJob(
        cluster,
        tmp_path / "job",
        backend,
        endpoint,
        nnodes="2:3",
        conf={"last_call_timeout": 1},
        args=["--max-restarts=0"],
        script=script,
        env=env,
    )
    formed = job.start_together(nodes, FORM_TIMEOUT)
    assert formed, f"the 3-node job did not form\n{job.texts()}"
    # The victim: for c10d the last host (not the store's); for etcd the round's rank 0,
    # the one every other member watches.
    victim: Host = nodes[-1]
    if backend != "c10d":
        victim = next(h for h in nodes if (r := job.latest(h)) and r["group_rank"] == 0)
    survivors = [h for h in nodes if h is not victim]
    pids = [r["pid"] for r in job.starts() if r["host"] == victim.name]
    exits = ExitWatch(pids)
    try:
        block.write_text(victim.name)
        time.sleep(0.5)  # the victim's main loop is inside the plugin now
        cut = time.time()
        cluster.cut(victim)
        ok = wait_until(lambda: job.running_together(survivors, cut), 40)
        assert ok, f"the survivors did not regroup\n{job.texts()}"
        assert wait_until(lambda: exits.all_exited() is not None, 30), job.texts()
        gone = exits.all_exited()
        assert gone is not None
        names = {h.name for h in survivors}
        new_round = min(r["t"] for r in job.starts() if r["host"] in names and r["t"] > cut)
        gap = new_round - gone
        print(
            f"{backend} cut: the cut-off node's workers exited {gone - cut:.2f}s after the "
            f"cut, the survivors' new workers started at {new_round - cut:.2f}s "
            f"({gap:.2f}s later)"
        )
        assert gap >= GAP, (
            f"the cut-off node's workers exited {gone - cut:.2f}s after the cut, only "
            f"{gap:.2f}s before the survivors' new round ({new_round - cut:.2f}s)\n{job.texts()}"
        )
    finally:
        exits.stop()
        job.finish()
        victim.kill()
