"""The c10d store on a simulated network: it moves as often as its holders are preempted,
whatever the job is doing, and a replacement agent joins the run's store, never a new one.

Real agents (``python -m elastic run``), one per host of a ``cluster_factory`` cluster,
one worker per node (``elastic.harness.multihost``). Limits as in ``test_faults.py``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from elastic.harness.c10d_handlers import write_token_file
from elastic.harness.cluster import Cluster, Host
from elastic.harness.multihost import C10D_PORT, FaultJob, wait_until

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]

MARGIN = 2.0
TERM_LIMIT = 4.0 + MARGIN
FORM_TIMEOUT = 60.0
EXIT_LIMIT = 5.0
# s two rounds' workers may overlap while one replaces the other (the old stopping)
OVERLAP_LIMIT = 2.0


def start(
    make: Make, tmp: Path, size: int, nnodes: str, endpoints: int = 1, token: bool = False
) -> FaultJob:
    cluster = make(size)
    hosts = list(cluster.hosts)
    endpoint = ",".join(f"{h.name}:{C10D_PORT}" for h in hosts[:endpoints])
    conf: dict[str, object] = {"last_call_timeout": 1}
    if token:
        conf["token_file"] = write_token_file(tmp / "token", b"the-job-token\n")
    job = FaultJob(
        cluster, tmp / "job", "c10d", endpoint, nnodes=nnodes, conf=conf,
        args=["--max-restarts=0"],
    )  # fmt: skip
    assert job.start_together(hosts, FORM_TIMEOUT), f"the job did not form\n{job.texts()}"
    return job


def preempt(job: FaultJob, host: Host) -> float:
    at = time.time()
    os.kill(job.nodes[host.name].proc.pid, signal.SIGTERM)
    return at


def regrouped(job: FaultJob, hosts: list[Host], since: float, what: str) -> float:
    ok = wait_until(lambda: job.running_together(hosts, since), TERM_LIMIT + 20)
    assert ok, f"{what}: {[h.name for h in hosts]} never ran again together\n{job.texts()}"
    took = job.regroup_time(hosts, since)
    assert took <= TERM_LIMIT, f"{what}: ran again after {took:.2f}s (limit {TERM_LIMIT:.1f}s)"
    return took


def new_holder(job: FaultJob, left: Host, hosts: list[Host]) -> Host:
    """Whom ``left``'s agent handed the store to, from its line saying so, once it
    exited as a preempted agent does."""
    node = job.nodes[left.name]
    assert node.wait(timeout=30) == 128 + signal.SIGTERM, node.text()
    return handed_to(job, left, hosts)


def handed_to(job: FaultJob, left: Host, hosts: list[Host]) -> Host:
    text = job.nodes[left.name].text()
    found = re.search(r"handed the c10d rendezvous store over to (\S+?):\d+;", text)
    assert found, text
    return next(h for h in hosts if found[1] in (h.name, h.addr))


def no_restart_spent(job: FaultJob) -> None:
    spent = [r for r in job.starts() if r["restart"] != 0]
    assert not spent, f"a departure spent the restart budget: {spent}\n{job.texts()}"


def finish(job: FaultJob, hosts: list[Host]) -> None:
    job.finish()
    for host in hosts:
        code = job.nodes[host.name].wait(timeout=EXIT_LIMIT + 30)
        assert code == 0, f"{host.name} exited {code}\n{job.texts()}"


@pytest.mark.timeout(180)
def test_the_store_moves_twice(cluster_factory: Make, tmp_path: Path) -> None:
    """4 nodes, one endpoint: the store's host is preempted, then the node that took the
    store: the last two train on, no restart spent, and finish."""
    job = start(cluster_factory, tmp_path, 4, "2:4")
    hosts = list(job.cluster.hosts)
    first = hosts[0]
    at = preempt(job, first)
    rest = hosts[1:]
    took = regrouped(job, rest, at, "first move")
    second = new_holder(job, first, rest)
    at2 = preempt(job, second)
    rest = [h for h in rest if h is not second]
    took2 = regrouped(job, rest, at2, "second move")
    third = new_holder(job, second, rest)
    assert third in rest
    no_restart_spent(job)
    finish(job, rest)
    print(f"c10d store moved twice: survivors ran again after {took:.2f}s and {took2:.2f}s")


@pytest.mark.timeout(180)
def test_a_replacement_on_the_first_endpoint_joins_the_moved_store(
    cluster_factory: Make, tmp_path: Path
) -> None:
    """1:3, ``--rdzv-endpoint=node0,node1,node2``: node0 (the store's host) is preempted,
    the job goes on with two; an agent started again on node0 with the same command joins
    them (one world of 3), not a world of its own."""
    job = start(cluster_factory, tmp_path, 3, "1:3", endpoints=3)
    hosts = list(job.cluster.hosts)
    at = preempt(job, hosts[0])
    took = regrouped(job, hosts[1:], at, "store host preempted")
    new_holder(job, hosts[0], hosts[1:])
    again = time.time()
    job.start(hosts[0])
    ok = wait_until(lambda: job.running_together(hosts, again), FORM_TIMEOUT)
    alone = [r for r in job.starts() if r["host"] == hosts[0].name and r["t"] > again]
    assert ok, f"the replacement never joined the run's store\n{job.texts()}"
    assert {r["world"] for r in alone} == {3}, (
        f"the replacement trained apart: {alone}\n{job.texts()}"
    )
    no_restart_spent(job)
    finish(job, hosts)
    print(f"replacement on the first endpoint host joined; survivors had run after {took:.2f}s")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("token", [False, True], ids=["open", "token"])
def test_a_replacement_with_one_endpoint_is_redirected_to_the_moved_store(
    cluster_factory: Make, tmp_path: Path, token: bool
) -> None:
    """1:3 with one ``--rdzv-endpoint`` (node0): node0 is preempted, the store moves and
    the job goes on with two; an agent started again on node0 with the same command opens
    a store there, which the run's holder redirects: it joins the survivors (one world of
    3), and at no time do two worlds train."""
    job = start(cluster_factory, tmp_path, 3, "1:3", token=token)
    hosts = list(job.cluster.hosts)
    at = preempt(job, hosts[0])
    took = regrouped(job, hosts[1:], at, "store host preempted")
    holder = new_holder(job, hosts[0], hosts[1:])
    again = time.time()
    job.start(hosts[0])
    ok = wait_until(
        lambda: job.running_together(hosts, again) or bool(two_worlds(job, again)), FORM_TIMEOUT
    )
    time.sleep(OVERLAP_LIMIT)  # a world started apart at the end would show by now
    both = two_worlds(job, again)
    assert not both, f"two worlds trained at once: {both}\n{job.texts()}"
    assert ok, f"the replacement never joined the run's store\n{job.texts()}"
    assert "redirected to the run's c10d store" in job.nodes[hosts[0].name].text(), job.texts()
    joined = job.regroup_time(hosts, again)
    no_restart_spent(job)
    finish(job, hosts)
    print(
        f"replacement redirected to {holder.name}: one world of 3 {joined:.2f}s after its "
        f"start; survivors had run again {took:.2f}s after the preemption"
    )


def two_worlds(job: FaultJob, since: float) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of workers of different rounds (masters) that ran at the same time for more
    than ``OVERLAP_LIMIT`` s after ``since``: a worker runs from its start record until its
    stop record (its agent's SIGTERM), the next start on its host, or now."""
    starts = job.starts()
    stopped = {
        r["pid"]: r["t"] for h in job.cluster.hosts for r in job.stops(h)
    }  # fmt: skip
    spans = []
    for r in starts:
        later = [s["t"] for s in starts if s["host"] == r["host"] and s["t"] > r["t"]]
        end = min([stopped.get(r["pid"], time.time()), *later])
        if end > since:
            spans.append((max(r["t"], since), end, r))
    return [
        (a, b)
        for i, (a0, a1, a) in enumerate(spans)
        for b0, b1, b in spans[i + 1 :]
        if a["master"] != b["master"] and min(a1, b1) - max(a0, b0) > OVERLAP_LIMIT
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("gap", [0.3, 1.5])
def test_the_store_host_preempted_during_a_regroup(
    cluster_factory: Make, tmp_path: Path, gap: float
) -> None:
    """A member is preempted, and ``gap`` s later (while the others regroup, or once
    they run again) the store's host: the two left train together."""
    job = start(cluster_factory, tmp_path, 4, "2:4")
    hosts = list(job.cluster.hosts)
    at = preempt(job, hosts[3])
    time.sleep(gap)
    preempt(job, hosts[0])
    rest = hosts[1:3]
    took = regrouped(job, rest, at, "member then store host")
    new_holder(job, hosts[0], rest)
    no_restart_spent(job)
    finish(job, rest)
    print(f"member, then the store host {gap}s later: the rest ran again after {took:.2f}s")


@pytest.mark.timeout(180)
def test_the_store_moves_twice_within_a_second(cluster_factory: Make, tmp_path: Path) -> None:
    """The node that took the store is preempted the moment it has it (before anyone
    regrouped on it): it hands it on in turn, and the last two train on."""
    job = start(cluster_factory, tmp_path, 4, "2:4")
    hosts = list(job.cluster.hosts)
    at = preempt(job, hosts[0])
    told = wait_until(lambda: "handed the c10d" in job.nodes[hosts[0].name].text(), 10, 0.01)
    assert told, job.texts()
    second = handed_to(job, hosts[0], hosts[1:])
    gap = preempt(job, second) - at
    assert gap < 1.0, f"the second preemption came {gap:.2f}s after the first"
    rest = [h for h in hosts[1:] if h is not second]
    took = regrouped(job, rest, at, "two moves within a second")
    assert new_holder(job, second, rest) in rest
    no_restart_spent(job)
    finish(job, rest)
    print(f"c10d store moved twice {gap:.2f}s apart: the rest ran again after {took:.2f}s")
