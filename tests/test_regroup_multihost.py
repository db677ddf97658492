"""Regrouping in place on a simulated multi-host network (issue 25): real agents (``python
-m elastic run``, c10d, the store on host 0), one per host, running
``elastic.harness.regroup_job.REGROUP_WORKER``: an ``elastic.train`` job on gloo with no
checkpointer, whose integer state ends bit-identical to an unbroken run's
(``--reference``) whatever the membership did.

- SIGTERM to one node of three (a preemption notice): the survivors' workers keep their
  processes (no new start, the same pids), go on from the step every rank stopped at (at
  most one step redone), spend no restart (``--max-restarts=0``), and end exact.
- SIGKILL of a node (agent and workers at once): the survivors' collective breaks, they
  roll the step back and regroup in the same processes.
- A worker that cannot reach a step boundary (asleep in a step) is stopped after the
  agent's bound and started again in the new round; the others, waiting for it in a
  collective, stay (the agents read the workers' stacks), whether its node is the new
  round's rank 0 or not.
- A third node joining a 2-node job: the two keep their processes and the newcomer gets
  the state through ``state.sync``.
- ``examples/ddp_regroup.py`` (the low-level API with DDP): a node preempted, the
  survivors' processes train on to the end.

A script that does not opt in keeps today's restart path: ``tests/test_preemption_multihost.py``
and ``tests/test_faults.py`` run plain scripts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic.harness.cluster import Cluster, Host
from elastic.harness.multihost import C10D_PORT, FaultJob, wait_until
from elastic.harness.preemption_job import read_events
from elastic.harness.regroup_job import (
    FORM_TIMEOUT,
    JOIN_STEPS,
    PAUSE,
    REJOIN_STEPS,
    STEPS,
    finish,
    hurry_once,
    last_step,
    reference_run,
    regroup_job,
    start_job,
)

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]


def kept_in_place(
    job: FaultJob,
    since: float,
    old: int,
    new: int,
    kept: list[Host],
    value: int,
    steps: int = STEPS,
) -> dict[str, float]:
    """The workers of ``kept`` went from the ``old``-rank world to the ``new``-rank one in
    the same processes, at most one step redone, no restart spent, the final value exact.
    Returns the seconds from ``since`` to the first step in the new world, and the steps
    redone."""
    seen = read_events(job.workdir)
    names = {h.name for h in kept}
    before = {(e["host"], e["pid"]) for e in seen if e["world"] == old and e["host"] in names}
    after = {(e["host"], e["pid"]) for e in seen if e["world"] == new and e["host"] in names}
    assert after and after == before, f"not the same workers: {before} -> {after}"
    restarted = [r for r in job.starts() if r["host"] in names and r["t"] > since]
    assert not restarted, f"workers started again: {restarted}\n{job.texts()}"
    steps_old = [e for e in seen if e["event"] == "step" and e["world"] == old]
    steps_new = [e for e in seen if e["event"] == "step" and e["world"] == new]
    assert steps_new, f"no step in the new world\n{job.texts()}"
    last_old = max(e["step"] for e in steps_old)
    first_new = min(e["step"] for e in steps_new)
    redone = last_old - first_new + 1
    assert 0 <= redone <= 1, f"last step {last_old} before, first {first_new} after"
    assert {e["restart"] for e in seen} == {0}, "a restart was spent"
    done = [e for e in seen if e["event"] == "done"]
    assert done and {e["value"] for e in done} == {value}, (done, value)
    assert {e["step"] for e in done} == {steps}, done
    first = min(e["t"] for e in steps_new)
    return {"first_step": first - since, "redone": redone}


@pytest.mark.timeout(180)
def test_a_preempted_node_leaves_and_the_survivors_keep_their_processes(
    cluster_factory: Make, tmp_path: Path
) -> None:
    with reference_run(tmp_path) as expected:
        cluster = cluster_factory(3)
        nodes = list(cluster.hosts)
        # The hang watchdog follows the kept workers' pids into the new round: a stall
        # verdict would fail the job (no restart allowed).
        job = start_job(cluster, tmp_path, "2:3", nodes, args=("--stall-timeout=20",))
        victim, survivors = nodes[2], nodes[:2]  # nodes[0] hosts the c10d store
        signalled = time.time()
        os.kill(job.nodes[victim.name].proc.pid, signal.SIGTERM)
        code = job.nodes[victim.name].wait(timeout=40)
        assert code == 128 + signal.SIGTERM, f"{victim.name} exited {code}\n{job.texts()}"
        hurry_once(job, survivors, 2, signalled)
        finish(job, survivors)
        value = expected()
    figures = kept_in_place(job, signalled, 3, 2, survivors, value)
    print(f"SIGTERM: first step in the new world {figures['first_step']:.2f}s after the notice")


@pytest.mark.timeout(180)
def test_a_crashed_node_breaks_a_step_the_survivors_roll_back_and_regroup(
    cluster_factory: Make, tmp_path: Path
) -> None:
    with reference_run(tmp_path) as expected:
        cluster = cluster_factory(3)
        nodes = list(cluster.hosts)
        job = start_job(cluster, tmp_path, "2:3", nodes)
        victim, survivors = nodes[2], nodes[:2]
        killed = time.time()
        victim.kill()  # the agent and its workers at once
        hurry_once(job, survivors, 2, killed)
        finish(job, survivors)
        value = expected()
    figures = kept_in_place(job, killed, 3, 2, survivors, value)
    print(f"SIGKILL: first step in the new world {figures['first_step']:.2f}s after the kill")


def node_rank(text: str) -> int:
    """The node rank an agent's output gives it in the last round it saw formed."""
    ranks = re.findall(r"round \d+ formed: .*this node is rank (\d+)", text)
    assert ranks, text
    return int(ranks[-1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stuck_rank", [0, 1], ids=["stuck-node-rank-0", "stuck-node-rank-1"])
def test_a_worker_that_misses_the_boundary_is_restarted_and_the_others_stay(
    cluster_factory: Make, tmp_path: Path, stuck_rank: int
) -> None:
    """Never a hang: a worker sleeps in a step when host 2 dies; its agent stops it once
    the bound runs out and starts a new one in the round, which gets the state from the
    other survivor's kept worker through ``state.sync``; no restart of the budget is
    spent. The other survivor's worker waits for it in a collective: its agent, reading
    the stacks, keeps it, whichever of the two nodes is the new round's rank 0 (the
    stuck one is chosen by its rank: a round keeps its members' order)."""
    with reference_run(tmp_path) as expected:
        cluster = cluster_factory(3)
        nodes = list(cluster.hosts)
        job = start_job(cluster, tmp_path, "2:3", nodes)
        survivors = sorted(nodes[:2], key=lambda h: node_rank(job.nodes[h.name].text()))
        stuck, kept = survivors[stuck_rank], survivors[1 - stuck_rank]
        (job.workdir / f"stall-{stuck.name}").touch()
        time.sleep(3 * PAUSE)  # the stuck worker is in its long step
        killed = time.time()
        nodes[2].kill()
        hurry_once(job, nodes[:2], 2, killed)
        finish(job, nodes[:2])
        value = expected()
    stuck_text = job.nodes[stuck.name].text()
    assert node_rank(stuck_text) == stuck_rank, stuck_text  # the case this run covers
    assert "did not take the new round in time" in stuck_text, job.texts()
    assert "in train_step: time.sleep" in stuck_text, job.texts()  # where it was stuck
    figures = kept_in_place(job, killed, 3, 2, [kept], value)
    restarted = [r for r in job.starts() if r["host"] == stuck.name and r["t"] > killed]
    assert len(restarted) == 1 and restarted[0]["restart"] == 0, restarted
    print(f"a stuck worker: the kept one's first step {figures['first_step']:.2f}s after the kill")


@pytest.mark.timeout(180)
def test_a_joining_node_gets_the_state_and_the_others_keep_their_processes(
    cluster_factory: Make, tmp_path: Path
) -> None:
    with reference_run(tmp_path, JOIN_STEPS) as expected:
        cluster = cluster_factory(3)
        nodes = list(cluster.hosts)
        job = start_job(cluster, tmp_path, "2:3", nodes[:2], JOIN_STEPS)
        joined = time.time()
        job.start(nodes[2])
        hurry_once(job, nodes, 3, joined)
        finish(job, nodes)
        value = expected()
    figures = kept_in_place(job, joined, 2, 3, nodes[:2], value, JOIN_STEPS)
    seen = read_events(job.workdir)
    newcomer = [e for e in seen if e["host"] == nodes[2].name and e["event"] == "sync"]
    assert newcomer and newcomer[0]["step"] > 0, newcomer  # it got the state by sync
    seen_steps = [e for e in seen if e["event"] == "step" and e["host"] == nodes[0].name]
    last_old = max(e["t"] for e in seen_steps if e["world"] == 2)
    first_new = min(e["t"] for e in seen_steps if e["world"] == 3)
    print(
        f"join: first step in the 3-node world {figures['first_step']:.2f}s after the start; "
        f"the others paused {first_new - last_old:.2f}s"
    )


@pytest.mark.timeout(180)
def test_the_ddp_example_regroups_in_place_with_the_low_level_api(
    cluster_factory: Make, tmp_path: Path
) -> None:
    """examples/ddp_regroup.py (``elastic.membership_changed`` / ``elastic.regroup``): a
    node preempted, the survivors' processes go on in the 2-node world to the end."""
    example = Path(__file__).resolve().parent.parent / "examples" / "ddp_regroup.py"
    progress, out = tmp_path / "progress", tmp_path / "params.json"
    progress.mkdir()
    cluster = cluster_factory(3)
    nodes = list(cluster.hosts)
    job = FaultJob(
        cluster,
        tmp_path / "job",
        "c10d",
        f"{nodes[0].name}:{C10D_PORT}",
        nnodes="2:3",
        conf={"last_call_timeout": 1},
        args=["--max-restarts=0"],
        script=example,
        script_args=["--steps", "150", "--progress-dir", str(progress), "--out", str(out)],
        run_id="ddp-regroup",
    )
    for host in nodes:
        job.start(host)

    def pids() -> dict[int, tuple[int, int]]:
        found = {}
        for path in progress.glob("rank*.json"):
            with contextlib.suppress(ValueError, OSError):
                rec = json.loads(path.read_text())
                found[rec["rank"]] = (rec["pid"], rec["step"])
        return found

    trained = wait_until(lambda: len(pids()) == 3 and min(s for _, s in pids().values()) >= 5, 90)
    assert trained, f"the 3-node job did not train\n{job.texts()}"
    before = {pid for pid, _ in pids().values()}
    os.kill(job.nodes[nodes[2].name].proc.pid, signal.SIGTERM)
    assert job.nodes[nodes[2].name].wait(timeout=40) == 128 + signal.SIGTERM, job.texts()
    finish(job, nodes[:2])
    after = pids()
    assert {r: s for r, (_, s) in after.items() if r < 2} == {0: 150, 1: 150}, after
    assert {after[0][0], after[1][0]} <= before, f"new processes: {before} -> {after}"
    assert json.loads(out.read_text())["step"] == 150


@pytest.mark.timeout(180)
def test_a_job_that_finishes_while_a_node_joins_ends_with_success_everywhere(
    cluster_factory: Make, tmp_path: Path
) -> None:
    """The kept workers train on while a joiner starts; when they finish the job first
    (10 steps left, less than the joiner's start-up), every agent, the joiner's too,
    meets at the new round's exit barrier and exits 0: no restart, no lost store."""
    steps = 25
    with reference_run(tmp_path, steps) as expected:
        cluster = cluster_factory(3)
        nodes = list(cluster.hosts)
        job = regroup_job(
            cluster, tmp_path, steps=steps, pause=PAUSE, nnodes="2:3", args=["--max-restarts=0"]
        )
        assert job.start_together(nodes[:2], FORM_TIMEOUT), job.texts()
        late = lambda: last_step(read_events(job.workdir), 2) >= steps - 10  # noqa: E731
        assert wait_until(late, 60), job.texts()
        job.start(nodes[2])
        finish(job, nodes)
        value = expected()
    seen = read_events(job.workdir)
    assert not [e for e in seen if e["world"] == 3 and e["event"] == "step"], job.texts()
    done = [e for e in seen if e["event"] == "done"]
    assert {e["value"] for e in done} == {value} and len(done) == 2, done
    assert {e["restart"] for e in seen} == {0}


@pytest.mark.timeout(180)
def test_a_node_whose_worker_crashed_rejoins_while_the_others_train(
    cluster_factory: Make, tmp_path: Path
) -> None:
    """One node's worker dies (SIGKILL of the worker alone): its agent starts a new one
    (a restart of the budget), the others' workers, whose group broke under them, are
    kept. They form a round of their own (``records.kept_first``) and train in it while
    the new worker starts (4 s here, a big model), then take the crashed node back in
    the round after; the final state is exact."""
    with reference_run(tmp_path, REJOIN_STEPS) as expected:
        cluster = cluster_factory(3)
        nodes = list(cluster.hosts)
        job = start_job(cluster, tmp_path, "2:3", nodes, REJOIN_STEPS, args=("--max-restarts=1",))
        crashed, kept = nodes[2], nodes[:2]
        (job.workdir / f"slow-start-{crashed.name}").write_text("4")
        worker = job.latest(crashed)
        assert worker is not None
        killed = time.time()
        os.kill(worker["pid"], signal.SIGKILL)
        hurry_once(job, nodes, 3, killed)
        finish(job, nodes)
        value = expected()
    seen = read_events(job.workdir)
    names = {h.name for h in kept}
    pids = {(e["host"], e["pid"]) for e in seen if e["host"] in names}
    assert len(pids) == 2, f"the kept workers were started again: {pids}\n{job.texts()}"
    back = [e for e in seen if e["event"] == "step" and e["world"] == 3 and e["t"] > killed]
    assert {e["host"] for e in back} == {h.name for h in nodes}, job.texts()
    first = min(e["t"] for e in back)
    alone = [e for e in seen if e["event"] == "step" and e["world"] == 2 and e["t"] < first]
    assert {e["host"] for e in alone} == names, f"{alone}\n{job.texts()}"
    done = [e for e in seen if e["event"] == "done"]
    assert len(done) == 3 and {e["value"] for e in done} == {value}, done
    print(
        f"a crashed worker: {len(alone) // 2} steps in the 2-node world while its "
        f"replacement started, the 3-node world {first - killed:.2f}s after the kill"
    )
