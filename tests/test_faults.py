"""Every way a node can leave a ``--nnodes=2:3`` job, on a simulated network (issue 13).

Real agents (``python -m elastic run``) run one per host of a ``cluster_factory`` cluster,
each host with its own address and name, one worker per node; the c10d store is hosted by
the agent on host 0, etcd runs on a host of its own. Workers record when they start and
when their agent stops them (``elastic.harness.multihost``), on one shared clock, so every
limit below is checked against measured times, which the assertion messages show:

- SIGTERM to an agent (preemption): survivors run again within ``TERM_LIMIT`` s, no
  restart spent (``--max-restarts=0``, ``TORCHELASTIC_RESTART_COUNT`` stays 0), and they
  exit 0 within ``EXIT_LIMIT`` s of their workers finishing;
- SIGKILL of a whole node: survivors run again within ``heartbeat_timeout + 1`` s;
- a cut cable: the cut-off node stops its workers within ``heartbeat_timeout + 1`` s with
  one line saying why, and before the survivors start the round that replaces it (its
  lease ends before they may count it lost); after the heal it rejoins by itself;
- c10d store loss: every survivor exits non-zero within ``heartbeat_timeout + 1`` s with
  one line naming the store and pointing to etcd-v3; an etcd member lost changes nothing.

``MARGIN`` s are added to every limit for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic.harness.cluster import Cluster, Host
from elastic.harness.multihost import C10D_PORT, FaultJob, serve_rendezvous, wait_until

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]

HEARTBEAT_TIMEOUT = 3.0  # what FAST sets; the liveness limits below follow from it
FAST = {"heartbeat_interval": 0.5, "heartbeat_timeout": HEARTBEAT_TIMEOUT}
MARGIN = 2.0  # s: scheduling delays of a loaded 2-core machine
TERM_LIMIT = 4.0 + MARGIN  # "within ~2 s of the signal" (+ margin)
LIVENESS_LIMIT = HEARTBEAT_TIMEOUT + 1.0 + MARGIN
EXIT_LIMIT = 5.0  # s from the stop file to every survivor's exit
FORM_TIMEOUT = 60.0  # first round: every agent imports and connects on 2 cores


class Setup:
    """A running 3-node job and the hosts it runs on."""

    def __init__(self, cluster: Cluster, job: FaultJob, nodes: list[Host]) -> None:
        self.cluster, self.job, self.nodes = cluster, job, nodes

    def victim(self) -> Host:
        """The node to take away: for etcd the current rank 0 (everyone else watches only
        rank 0, the hardest loss to notice); for c10d the last host (not the store's)."""
        if self.job.backend == "c10d":
            return self.nodes[-1]
        return next(h for h in self.nodes if (r := self.job.latest(h)) and r["group_rank"] == 0)

    def survivors(self, victim: Host) -> list[Host]:
        return [h for h in self.nodes if h is not victim]

    def finish(self, hosts: list[Host]) -> float:
        """Touch the stop file; every agent on ``hosts`` must exit 0. Returns the slowest
        exit, in seconds from the touch."""
        self.job.finish()
        touched, slowest = time.monotonic(), 0.0
        for host in hosts:
            code = self.job.nodes[host.name].wait(timeout=EXIT_LIMIT + 30)
            slowest = max(slowest, time.monotonic() - touched)
            assert code == 0, f"{host.name} exited {code}\n{self.job.texts()}"
        return slowest


@pytest.fixture
def start_job(cluster_factory: Make, tmp_path: Path) -> Iterator[Callable[..., Setup]]:
    def start(
        backend: str, conf: dict[str, Any] | None = None, etcd_members: int = 1, size: int = 3
    ) -> Setup:
        cluster = cluster_factory(size if backend == "c10d" else size + etcd_members)
        nodes, endpoint = serve_rendezvous(cluster, backend, tmp_path, size)
        conf = dict(conf or {})
        job = FaultJob(
            cluster,
            tmp_path / "job",
            backend,
            endpoint,
            nnodes=f"2:{size}",
            conf={"last_call_timeout": 1, **conf},
            args=["--max-restarts=0"],
        )
        formed = job.start_together(nodes, FORM_TIMEOUT)
        assert formed, f"the {size}-node job did not form\n{job.texts()}"
        return Setup(cluster, job, nodes)

    yield start


def no_restart_spent(job: FaultJob) -> None:
    spent = [r for r in job.starts() if r["restart"] != 0]
    assert not spent, f"a departure spent the restart budget: {spent}\n{job.texts()}"


def regrouped(setup: Setup, survivors: list[Host], since: float, limit: float, what: str) -> float:
    job = setup.job
    ok = wait_until(lambda: job.running_together(survivors, since), limit + 20)
    assert ok, f"{what}: the survivors never ran again as a 2-node job\n{job.texts()}"
    took = job.regroup_time(survivors, since)
    assert took <= limit, f"{what}: survivors ran again after {took:.2f}s (limit {limit:.1f}s)"
    return took


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["c10d", "etcd-v3", "etcd-v2"])  # etcd: etcd-v2's code
def test_sigterm_to_an_agent_is_a_departure(start_job: Callable[..., Setup], backend: str) -> None:
    setup = start_job(backend)  # heartbeat defaults: 1 s, timeout 5 s
    victim = setup.victim()
    survivors = setup.survivors(victim)
    node = setup.job.nodes[victim.name]
    signalled = time.time()
    os.kill(node.proc.pid, signal.SIGTERM)
    took = regrouped(setup, survivors, signalled, TERM_LIMIT, f"{backend} SIGTERM")
    assert node.wait(timeout=30) == 128 + signal.SIGTERM, node.text()
    assert setup.job.stops(victim), f"{victim.name}'s worker was not stopped\n{node.text()}"
    no_restart_spent(setup.job)
    slowest = setup.finish(survivors)
    assert slowest <= EXIT_LIMIT, f"survivors exited {slowest:.2f}s after finishing"
    print(f"{backend} SIGTERM: regrouped in {took:.2f}s, exited {slowest:.2f}s after finishing")


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "leaving"), [("c10d", 3), ("etcd-v3", 2)])
def test_nodes_preempted_within_a_second_cost_a_round_each_at_most(
    start_job: Callable[..., Setup], backend: str, leaving: int
) -> None:
    """Two or three of five nodes get SIGTERM 0.4 s apart: the rest run together within
    3 s of the first notice (plus the margin), with no restart spent, nobody waiting for a
    last call (30 s here), and none of the nodes that left. Notices that land before the
    next round forms share it; one that lands after it costs one more round (a regroup
    takes about 0.5 s, so which happens depends on timing): never more rounds than notices.
    """
    setup = start_job(backend, {"last_call_timeout": 30}, size=5)
    gone = setup.nodes[-leaving:]  # never the c10d store's host
    survivors = [h for h in setup.nodes if h not in gone]
    signalled = time.time()
    for i, host in enumerate(gone):
        if i:
            time.sleep(0.4)
        os.kill(setup.job.nodes[host.name].proc.pid, signal.SIGTERM)
    took = regrouped(setup, survivors, signalled, 3.0 + MARGIN, f"{backend} {leaving} SIGTERMs")
    names = {h.name for h in survivors}
    # Every round has a master port of its own.
    rounds = {r["master"] for r in setup.job.starts() if r["host"] in names and r["t"] > signalled}
    assert len(rounds) <= leaving, f"{len(rounds)} rounds: {rounds}\n{setup.job.texts()}"
    no_restart_spent(setup.job)
    setup.finish(survivors)
    print(f"{backend} {leaving} preempted 0.4 s apart: {len(rounds)} round(s), {took:.2f}s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["c10d", "etcd-v3", "etcd-v2"])  # etcd: etcd-v2's code
def test_sigkill_of_a_node(start_job: Callable[..., Setup], backend: str) -> None:
    setup = start_job(backend, FAST)
    victim = setup.victim()
    survivors = setup.survivors(victim)
    killed = time.time()
    victim.kill()  # the agent and its workers at once: the machine is gone
    took = regrouped(setup, survivors, killed, LIVENESS_LIMIT, f"{backend} SIGKILL")
    no_restart_spent(setup.job)
    slowest = setup.finish(survivors)
    assert slowest <= EXIT_LIMIT, f"survivors exited {slowest:.2f}s after finishing"
    print(f"{backend} SIGKILL: regrouped in {took:.2f}s")


CUT_FOR = 10.0  # s the cable stays out: over three heartbeat_timeouts


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["c10d", "etcd-v3", "etcd-v2"])  # etcd: etcd-v2's code
def test_cut_node_stops_its_workers_and_rejoins_after_heal(
    start_job: Callable[..., Setup], backend: str
) -> None:
    setup = start_job(backend, FAST)
    job = setup.job
    victim = setup.victim()
    survivors = setup.survivors(victim)
    cut = time.time()
    setup.cluster.cut(victim)
    took = regrouped(setup, survivors, cut, LIVENESS_LIMIT, f"{backend} cut")
    assert wait_until(lambda: bool(job.stops(victim)), LIVENESS_LIMIT + 10), job.texts()
    fenced = job.stops(victim)[0]["t"] - cut
    assert fenced <= LIVENESS_LIMIT, (
        f"the cut-off node stopped its workers {fenced:.2f}s after the cut "
        f"(limit {LIVENESS_LIMIT:.1f}s)"
    )
    # Never two worlds at once: the cut-off node's workers were stopped before any survivor
    # started a worker of the round that replaced it (the lease ends before the verdict).
    names = {h.name for h in survivors}
    new_round = min(r["t"] for r in job.starts() if r["host"] in names and r["t"] > cut)
    gap = new_round - job.stops(victim)[0]["t"]
    assert gap > 0, (
        f"the survivors' new round started {-gap:.2f}s before the cut-off node's workers "
        f"were stopped\n{job.texts()}"
    )
    lines = job.nodes[victim.name].text().splitlines()
    why = [ln for ln in lines if ln.startswith("elastic: cannot reach the rendezvous store")]
    assert len(why) == 1, job.nodes[victim.name].text()  # one line saying why

    time.sleep(max(0.0, cut + CUT_FOR - time.time()))
    assert job.nodes[victim.name].proc.poll() is None, "the cut-off agent gave up"
    healed = time.time()
    setup.cluster.heal(victim)
    back = wait_until(lambda: job.running_together(setup.nodes, healed), 40)
    assert back, f"{victim.name} did not rejoin after the heal\n{job.texts()}"
    rejoined = job.regroup_time(setup.nodes, healed)
    no_restart_spent(job)
    setup.finish(setup.nodes)
    print(
        f"{backend} cut: survivors regrouped in {took:.2f}s, the cut-off node stopped its "
        f"workers after {fenced:.2f}s ({gap:.2f}s before the survivors' new round), 3 nodes "
        f"again {rejoined:.2f}s after the heal"
    )


@pytest.mark.timeout(120)
def test_c10d_store_host_preempted_hands_the_store_over(start_job: Callable[..., Setup]) -> None:
    """SIGTERM to the agent hosting the c10d store: the store moves to a survivor's agent,
    the job regroups without spending a restart and finishes."""
    setup = start_job("c10d")  # heartbeat defaults: 1 s, timeout 5 s
    store_host, *survivors = setup.nodes
    node = setup.job.nodes[store_host.name]
    signalled = time.time()
    os.kill(node.proc.pid, signal.SIGTERM)
    took = regrouped(setup, survivors, signalled, TERM_LIMIT, "c10d store host SIGTERM")
    assert node.wait(timeout=30) == 128 + signal.SIGTERM, node.text()
    assert "handed the c10d rendezvous store over" in node.text(), node.text()
    no_restart_spent(setup.job)
    slowest = setup.finish(survivors)
    assert slowest <= EXIT_LIMIT, f"survivors exited {slowest:.2f}s after finishing"
    print(f"c10d store host SIGTERM: regrouped in {took:.2f}s, exited {slowest:.2f}s later")


@pytest.mark.timeout(150)
def test_a_replacement_node_finds_the_moved_store_at_a_candidate_endpoint(
    cluster_factory: Make, tmp_path: Path
) -> None:
    """``--rdzv-endpoint=node0:29400,node1:29400``: node0's agent hosts, node1's keeps its
    standby on the second endpoint. node0 is preempted: the store moves to node1 and the
    job goes on with two nodes; a replacement agent started on node0 afterwards finds the
    store at node1 (not a new, empty one at node0) and the job grows back to three."""
    cluster = cluster_factory(3)
    nodes = list(cluster.hosts)
    endpoint = ",".join(f"{h.name}:{C10D_PORT}" for h in nodes[:2])
    job = FaultJob(
        cluster, tmp_path / "job", "c10d", endpoint, conf={"last_call_timeout": 1},
        args=["--max-restarts=0"],
    )  # fmt: skip
    assert job.start_together(nodes, FORM_TIMEOUT), f"the job did not form\n{job.texts()}"
    store_host, survivors = nodes[0], nodes[1:]
    node = job.nodes[store_host.name]
    signalled = time.time()
    os.kill(node.proc.pid, signal.SIGTERM)
    took = regrouped(Setup(cluster, job, nodes), survivors, signalled, TERM_LIMIT, "store moved")
    assert node.wait(timeout=30) == 128 + signal.SIGTERM, node.text()
    assert f"over to {nodes[1].name}:{C10D_PORT}" in node.text(), node.text()
    rejoined = time.time()
    job.start(store_host)  # the replacement, with the same command line
    ok = wait_until(lambda: job.running_together(nodes, rejoined), FORM_TIMEOUT)
    assert ok, f"the replacement never joined the moved store\n{job.texts()}"
    no_restart_spent(job)
    Setup(cluster, job, nodes).finish(nodes)
    print(f"store moved to a candidate endpoint: regrouped in {took:.2f}s, replacement joined")


@pytest.mark.timeout(90)
def test_c10d_store_loss_stops_every_survivor_with_one_line(
    start_job: Callable[..., Setup],
) -> None:
    setup = start_job("c10d", FAST)
    store_host, *others = setup.nodes
    killed = time.monotonic()
    store_host.kill()  # the agent hosting the store; the host stays up: connects are refused
    for host in others:
        node = setup.job.nodes[host.name]
        code = node.wait(timeout=LIVENESS_LIMIT + 20)
        took = time.monotonic() - killed
        assert code != 0, node.text()
        assert took <= LIVENESS_LIMIT, (
            f"{host.name} exited {took:.2f}s after the store was lost (limit {LIVENESS_LIMIT}s)"
        )
        assert setup.job.stops(host), f"{host.name}'s workers were not stopped\n{node.text()}"
        lines = [ln for ln in node.text().splitlines() if "store" in ln and "$ " not in ln]
        assert len(lines) == 1 and lines[0].startswith("elastic: "), node.text()
        assert f"{store_host.name}:{C10D_PORT}" in lines[0] and "etcd-v3" in lines[0], lines
        print(f"c10d store loss: {host.name} exited {code} after {took:.2f}s")


@pytest.mark.timeout(120)
def test_etcd_v3_member_loss_changes_nothing(start_job: Callable[..., Setup]) -> None:
    setup = start_job("etcd-v3", FAST, etcd_members=3)
    job = setup.job
    etcd_first = setup.cluster.hosts[3]  # first in every agent's endpoint list
    before = len(job.starts())
    etcd_first.kill()
    time.sleep(2 * HEARTBEAT_TIMEOUT + 1)
    assert len(job.starts()) == before, f"losing one etcd member disturbed the job\n{job.texts()}"
    victim = setup.victim()  # and a node loss is still handled by the two members left
    survivors = setup.survivors(victim)
    killed = time.time()
    victim.kill()
    took = regrouped(setup, survivors, killed, LIVENESS_LIMIT, "etcd-v3 -1 member, SIGKILL")
    no_restart_spent(job)
    setup.finish(survivors)
    print(f"etcd-v3 with a member down, SIGKILL: regrouped in {took:.2f}s")


TRAIN = """
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ckpt_dir, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
path = os.path.join(ckpt_dir, "ckpt.pt")
step = 0
if os.path.exists(path):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    step = state["step"]
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
print(f"TRAIN start rank={rank} world={world} step={step} "
      f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
while step < steps:
    g = torch.Generator().manual_seed(step)  # the global batch depends on the step only
    x = torch.randn(12, 4, generator=g)
    y = x.sum(1, keepdim=True)
    share = 12 // world  # 12 splits evenly over 2 or 3 nodes: the same mean gradient
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(xs), ys).backward()
    opt.step()
    step += 1
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": model.state_dict(), "step": step}, tmp)
        os.replace(tmp, path)  # atomic: a node stopped mid-save leaves the last one
    dist.barrier()  # nobody runs ahead of the checkpoint
    if not os.path.exists(os.path.join(ckpt_dir, "hurry")):  # the test saw the 2-node job
        time.sleep(0.1)
if rank == 0:
    weights = [float(v) for p in model.parameters() for v in p.flatten()]
    with open(os.path.join(ckpt_dir, "final.json"), "w") as f:
        json.dump({"step": step, "world": world, "weights": weights}, f)
del ddp  # before the group: see examples/ddp_train.py (a gloo hang or abort at exit)
dist.destroy_process_group()
"""

REFERENCE = """
import json, sys, torch
steps = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(steps):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()
print(json.dumps([float(v) for p in model.parameters() for v in p.flatten()]))
"""

STEPS = 60


@pytest.mark.timeout(240)
def test_ddp_job_finishes_on_the_survivors_after_a_sigterm(
    cluster_factory: Make, tmp_path: Path
) -> None:
    cluster = cluster_factory(3)
    nodes = list(cluster.hosts)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    reference = subprocess.Popen(  # while the job forms: the weights of an unbroken run
        [sys.executable, "-c", REFERENCE, str(STEPS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        job = FaultJob(
            cluster,
            tmp_path / "job",
            "c10d",
            f"{nodes[0].name}:{C10D_PORT}",
            conf={"last_call_timeout": 2},
            args=["--max-restarts=0"],
            script=script,
            script_args=[str(ckpt), str(STEPS)],
        )
        for host in nodes:
            job.start(host)
        # Once the 3-node job has trained a few steps, preempt node 2.
        three = lambda: all("world=3" in n.text() for n in job.nodes.values())  # noqa: E731
        assert wait_until(three, 120), job.texts()
        time.sleep(1.5)
        victim = nodes[2]
        os.kill(job.nodes[victim.name].proc.pid, signal.SIGTERM)
        # Both survivors' workers started in the 2-node job: the rest of the steps, there so
        # the job outlasts the departure, run without their pause.
        two = lambda: all("world=2" in job.nodes[h.name].text() for h in nodes[:2])  # noqa: E731
        ended = lambda: any(job.nodes[h.name].proc.poll() is not None for h in nodes[:2])  # noqa: E731
        if wait_until(lambda: two() or ended(), 120) and two():
            (ckpt / "hurry").touch()
        for host in nodes[:2]:
            code = job.nodes[host.name].wait(timeout=150)
            assert code == 0, f"{host.name} exited {code}\n{job.texts()}"
        assert job.nodes[victim.name].wait(timeout=30) == 128 + signal.SIGTERM
        out, err = reference.communicate(timeout=120)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    assert reference.returncode == 0, err
    final = json.loads((ckpt / "final.json").read_text())
    assert final["step"] == STEPS and final["world"] == 2, final
    expected = json.loads(out)
    assert max(abs(a - b) for a, b in zip(final["weights"], expected, strict=True)) < 1e-4, (
        final["weights"],
        expected,
    )
    logs = "".join(n.text() for n in job.nodes.values())
    assert "restart=1" not in logs, logs  # the departure spent nothing
    assert "hostname of the client socket cannot be retrieved" not in logs, logs
