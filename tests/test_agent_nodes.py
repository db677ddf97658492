"""Several agents sharing one job store: one restart per round, a job-wide budget, and a
finished node rejoining when a peer fails the round."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from elastic.core.agent.loop import LocalElasticAgent
from elastic.core.interfaces.spec import RunResult, WorkerState
from elastic.harness.commands import write_script as script
from elastic.harness.shared_rendezvous import NodeHandler, SharedRendezvous
from elastic.harness.worker_specs import make_spec

NODE_WORKER = """
import os, sys, time
out, failing, until, rest = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
node, count = os.environ["GROUP_RANK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(os.path.join(out, f"n{node}_r{os.environ['RANK']}_c{count}"), "w").close()
if node in failing and count < until:
    # fail once every rank of this attempt is up (a loaded machine starts them late)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sum(n.endswith(f"_c{count}") for n in os.listdir(out)) >= int(os.environ["WORLD_SIZE"]):
            break
        time.sleep(0.02)
    time.sleep(0.2)
    sys.exit(3)
time.sleep(float(rest))
"""


def run_nodes(
    tmp_path: Path, failing: str, until: int, max_restarts: int, rest: float = 1.0
) -> list[RunResult]:
    worker = script(tmp_path, "node.py", NODE_WORKER)
    shared = SharedRendezvous(2)
    results: list[Any] = [None, None]

    def node(i: int) -> None:
        spec = make_spec(
            NodeHandler(shared, f"node{i}"),
            ("-u", worker, str(tmp_path), failing, str(until), str(rest)),
            2,
            max_restarts=max_restarts,
        )
        results[i] = LocalElasticAgent(spec).run()

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(r, RunResult) for r in results)
    return results


def test_one_restart_per_round_across_nodes(tmp_path: Path) -> None:
    """Both nodes' workers fail in the same round: the job pays for one restart."""
    results = run_nodes(tmp_path, "0,1", 1, max_restarts=1)
    assert [r.state for r in results] == [WorkerState.SUCCEEDED] * 2
    assert sorted(p.name for p in tmp_path.glob("n*_c1")) == [
        "n0_r0_c1",
        "n0_r1_c1",
        "n1_r2_c1",
        "n1_r3_c1",
    ]


def test_peer_failure_restarts_healthy_node_and_budget_is_job_wide(tmp_path: Path) -> None:
    """Node 1 keeps failing: node 0 restarts with it (same RESTART_COUNT), then both fail
    once the job-wide budget is spent, with the same root cause."""
    # node 0's workers outlive node 1's last failure: they are stopped via agent/failed
    results = run_nodes(tmp_path, "1", 99, max_restarts=2, rest=5.0)
    assert [r.state for r in results] == [WorkerState.FAILED] * 2
    assert [r.exit_code for r in results] == [3, 3]
    assert not results[0].failures
    assert results[1].failures and set(results[1].failures) <= {2, 3}
    assert "another node" in results[0].message
    runs = sorted(p.name for p in tmp_path.glob("n0_r0_*"))
    assert runs == ["n0_r0_c0", "n0_r0_c1", "n0_r0_c2"]


def test_finished_node_rejoins_when_a_peer_fails_the_round(tmp_path: Path) -> None:
    """Node 0's workers are done (it waits in the exit barrier) when node 1's fail: the
    round failed, so node 0 rejoins instead of waiting for a peer that never comes."""
    t0 = time.monotonic()
    results = run_nodes(tmp_path, "1", 1, max_restarts=1, rest=0.0)
    assert time.monotonic() - t0 < 20
    assert [r.state for r in results] == [WorkerState.SUCCEEDED] * 2
    assert sorted(p.name for p in tmp_path.glob("n0_r0_*")) == ["n0_r0_c0", "n0_r0_c1"]
