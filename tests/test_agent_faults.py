"""Failures while the job changes, on a simulated network (issue 23).

Real agents (``python -m elastic run``), one per host of three hosts of one cluster shared
by every test here, on c10d (the store hosted by the agent on host 0) or etcd-v3 (one
member on a fourth host), one worker per node (``elastic.harness.multihost.WORKER``,
behind a prelude that fails it when asked):

- a node with a broken environment (its worker cannot import a module) joins a running
  ``2:3`` job: it leaves with its own error and one line saying why, the job goes on as
  two nodes, spends no restart and finishes; ``elastic status`` names that node;
- the workers of two nodes fail at the same moment: one restart is spent for both;
- a node's link goes down while its workers have just failed (it is publishing the
  failure and claiming a restart): it stops its workers and waits instead of exiting 1,
  rejoins after the heal, and the job finishes.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic.harness.cluster import Cluster, Host, require_cluster
from elastic.harness.multihost import WORKER, FaultJob, etcd_endpoint, start_etcd, wait_until

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 3.0
FAST = {"heartbeat_interval": 0.5, "heartbeat_timeout": HEARTBEAT_TIMEOUT, "last_call_timeout": 1}
FORM_TIMEOUT = 60.0  # every agent imports and connects on 2 loaded cores
EXIT_TIMEOUT = 40.0

# Fails the worker at import on a host whose agent has FAULTS_BROKEN=1 (a module only that
# host lacks), or once, with a Python error, when the file ``fail-<host>`` appears in the
# job's directory (renamed first, so the worker of the next round runs normally).
PRELUDE = """\
import os, socket, sys, time
if os.environ.get("FAULTS_BROKEN") == "1":
    import module_missing_on_this_host  # noqa: F401
if os.environ.get("FAULTS_FAIL_ON_FILE") == "1":
    import threading
    def fail_when_told():
        mine = os.path.join(os.environ["FAULTS_OUT"], "fail-" + socket.gethostname())
        while True:
            try:
                os.rename(mine, mine + ".done")
            except OSError:
                time.sleep(0.02)
                continue
            sys.stderr.write("Traceback (most recent call last):\\nRuntimeError: told to fail\\n")
            sys.stderr.flush()
            os._exit(3)
    threading.Thread(target=fail_when_told, daemon=True).start()
"""

_ports = itertools.count(29411)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for every test of this module: three hosts for the jobs and an etcd
    member on the fourth (building them takes seconds)."""
    require_cluster()
    made = Cluster(4)
    try:
        start_etcd(made.hosts[3:], tmp_path_factory.mktemp("etcd"))
        yield made
    finally:
        made.close()


def job_hosts(job: FaultJob) -> list[Host]:
    return list(job.cluster.hosts[:3])


@pytest.fixture
def make_job(cluster: Cluster, tmp_path: Path) -> Iterator[object]:
    """``make(nnodes, max_restarts, backend, gloo) -> FaultJob`` on the shared cluster, its
    own store port and run id; every process on the job hosts is killed at the end."""
    jobs: list[FaultJob] = []

    def make(nnodes: str, max_restarts: int, backend: str = "c10d", gloo: bool = False) -> FaultJob:
        script = tmp_path / "worker.py"
        script.write_text(PRELUDE + WORKER)
        port = next(_ports)
        c10d = f"{cluster.hosts[0].name}:{port}"
        job = FaultJob(
            cluster,
            tmp_path / f"job{port}",
            backend,
            c10d if backend == "c10d" else etcd_endpoint(cluster.hosts[3:]),
            nnodes=nnodes,
            conf=dict(FAST),
            # stderr teed through a file: the agent reads the worker's error from it
            args=[f"--max-restarts={max_restarts}", "--tee=2"],
            script=script,
            run_id=f"faults{port}",
            env={"FAULTS_FAIL_ON_FILE": "1"},
            gloo=gloo,
        )
        jobs.append(job)
        return job

    yield make
    for host in cluster.hosts[:3]:  # not etcd's
        host.kill()
    cluster.heal()


def finish(job: FaultJob, hosts: list[Host]) -> None:
    job.finish()
    for host in hosts:
        code = job.nodes[host.name].wait(timeout=EXIT_TIMEOUT)
        assert code == 0, f"{host.name} exited {code}\n{job.texts()}"


def restarts_seen(job: FaultJob) -> set[int]:
    return {r["restart"] for r in job.starts()}


def status(job: FaultJob, host: Host) -> dict:
    cmd = [
        sys.executable, "-m", "elastic", "status", f"--rdzv-backend={job.backend}",
        f"--rdzv-endpoint={job.endpoint}", f"--rdzv-id={job.run_id}", "--json",
    ]  # fmt: skip
    result = host.run(cmd, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["c10d", "etcd-v3"])
def test_a_broken_node_joining_a_running_job_leaves_alone(make_job, backend: str) -> None:
    # gloo: the good nodes' workers wait in init_process_group for the broken one's rank
    job = make_job("2:3", 0, backend, gloo=True)
    *good, broken = job_hosts(job)
    assert job.start_together(good, FORM_TIMEOUT), f"the 2-node job did not form\n{job.texts()}"
    joined = time.time()
    job.env["FAULTS_BROKEN"] = "1"
    node = job.start(broken)
    code = node.wait(timeout=FORM_TIMEOUT + 30)
    assert code != 0, node.text()
    lines = [ln for ln in node.text().splitlines() if ln.startswith("elastic: this node's")]
    assert len(lines) == 1, node.text()
    assert "module_missing_on_this_host" in lines[0] and "no restart" in lines[0], lines
    # The two good nodes ran with it (a 3-node round) or not, and run again as two.
    back = wait_until(lambda: job.running_together(good, joined), 60)
    assert back, f"the job did not go on as two nodes\n{job.texts()}"
    for host in good:
        assert job.nodes[host.name].proc.poll() is None, job.texts()
    seen = status(job, good[1])
    assert seen["restarts_used"] == 0, seen
    assert seen["root_cause"]["host"] == broken.name, seen["root_cause"]
    assert restarts_seen(job) == {0}, f"a restart was spent: {job.starts()}"
    finish(job, good)


@pytest.mark.timeout(240)
def test_two_nodes_failing_at_once_spend_one_restart(make_job) -> None:
    job = make_job("3:3", 1)  # a single failure budget: two restarts would end the job
    hosts = job_hosts(job)
    assert job.start_together(hosts, FORM_TIMEOUT), f"the job did not form\n{job.texts()}"
    failed = time.time()
    for host in hosts[1:]:
        (job.workdir / f"fail-{host.name}").touch()
    back = wait_until(lambda: job.running_together(hosts, failed), 90)
    assert back, f"the job did not run again\n{job.texts()}"
    latest = [job.latest(h) for h in hosts]
    assert all(r is not None and r["restart"] == 1 for r in latest), latest
    finish(job, hosts)


CUT_FOR = 15.0  # s: longer than the store client's read_timeout (10 s)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["c10d", "etcd-v3"])
def test_a_node_cut_off_while_handling_its_failure_fences_and_rejoins(
    make_job, backend: str
) -> None:
    job = make_job("2:3", 2, backend)
    hosts = job_hosts(job)
    victim, survivors = hosts[2], hosts[:2]
    assert job.start_together(hosts, FORM_TIMEOUT), f"the job did not form\n{job.texts()}"
    cut = time.time()
    job.cluster.cut(victim)
    (job.workdir / f"fail-{victim.name}").touch()  # its worker fails as the link goes
    back = wait_until(lambda: job.running_together(survivors, cut), 60)
    assert back, f"the survivors did not regroup\n{job.texts()}"
    time.sleep(max(0.0, cut + CUT_FOR - time.time()))
    node = job.nodes[victim.name]
    assert node.proc.poll() is None, f"the cut-off agent exited {node.proc.poll()}\n{node.text()}"
    lines = node.text().splitlines()
    assert any(ln.startswith("elastic: cannot reach the rendezvous store") for ln in lines), (
        node.text()
    )
    healed = time.time()
    job.cluster.heal(victim)
    rejoined = wait_until(lambda: job.running_together(hosts, healed), 60)
    assert rejoined, f"{victim.name} did not rejoin after the heal\n{job.texts()}"
    finish(job, hosts)
