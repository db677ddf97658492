"""A node that learns of the job's failure late exits with the job's code: it was cut off
(fenced, retrying the store) when the job failed, and finds the rendezvous closed once the
network is back (``core/agent/exit_code.py``). etcd-v3 on a host of its own, so the
store outlives the nodes; three simulated hosts run the job (``cluster_factory``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic.harness.cluster import Cluster
from elastic.harness.multihost import START_RECORD, FaultJob, serve_rendezvous
from elastic.testing.waits import wait_until

pytestmark = pytest.mark.slow

WORKER = (
    """\
import json, os, socket, sys, time
t0 = time.time()
"""
    + START_RECORD
    + """\
fail = os.path.join(out, "fail")
while not os.path.exists(os.path.join(out, "stop")):
    if os.path.exists(fail) and open(fail).read() == socket.gethostname():
        sys.exit(3)
    time.sleep(0.05)
"""
)


@pytest.mark.timeout(240)
def test_a_node_cut_off_while_the_job_failed_exits_with_its_code(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(4)
    nodes, endpoint = serve_rendezvous(cluster, "etcd-v3", tmp_path, 3)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    job = FaultJob(
        cluster,
        tmp_path / "job",
        "etcd-v3",
        endpoint,
        nnodes="2:3",
        conf={"last_call_timeout": 1, "heartbeat_interval": 0.5, "heartbeat_timeout": 3},
        args=["--max-restarts=0"],
        script=script,
    )
    assert job.start_together(nodes, 90), job.texts()
    late, failing = nodes[2], nodes[1]
    cluster.cut(late)
    assert wait_until(lambda: "cannot reach" in job.nodes[late.name].text(), 30), job.texts()
    (job.workdir / "fail").write_text(failing.name)  # no restart left: the job fails
    for host in nodes[:2]:
        assert job.nodes[host.name].wait(timeout=60) == 3, job.texts()
    assert job.nodes[late.name].proc.poll() is None  # still cut off, retrying
    time.sleep(1.0)
    cluster.heal(late)
    code = job.nodes[late.name].wait(timeout=60)
    assert code == 3, f"the late node exited {code}\n{job.texts()}"
    assert "the job failed on another node" in job.nodes[late.name].text() or (
        "FAILED (exit code 3)" in job.nodes[late.name].text()
    ), job.nodes[late.name].text()
