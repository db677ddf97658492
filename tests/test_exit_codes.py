"""Exit codes that never lie (``core/agent/exit_code.py``): a job that failed ends
non-zero on every node, whatever it saw of the end, and a node exits 0 only when it knows
the job succeeded. The rule, then each path with real agents: ``elastic run`` on
loopback (c10d), and agents sharing one in-memory rendezvous for the exit barrier."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from elastic.core.agent.exit_barrier import BarrierEnd, exit_barrier
from elastic.core.agent.exit_code import JobEnd, after_barrier, after_close, exit_code
from elastic.core.agent.loop import LocalElasticAgent
from elastic.core.interfaces.job_keys import FAILED_KEY
from elastic.core.interfaces.rendezvous import RendezvousClosedError, RendezvousInfo
from elastic.core.interfaces.spec import RunResult, WorkerState
from elastic.core.interfaces.store import LocalStore
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.harness.commands import write_script as script
from elastic.harness.processes import Processes
from elastic.harness.shared_rendezvous import NodeHandler, SharedRendezvous
from elastic.harness.worker_specs import make_spec
from elastic.testing.waits import wait_until


def test_the_rule() -> None:
    assert exit_code(JobEnd.SUCCEEDED) == 0
    assert exit_code(JobEnd.FAILED, root_cause=3) == 3
    assert exit_code(JobEnd.FAILED) == 1  # no record could be read: still a failure
    assert exit_code(JobEnd.LEFT_ALONE, root_cause=7) == 7
    assert exit_code(JobEnd.SIGNALLED, signum=15) == 143
    assert exit_code(JobEnd.UNKNOWN) == 1
    assert exit_code(JobEnd.NODE_ERROR) == 1
    assert exit_code(JobEnd.REFUSED) == 2
    # Only a flag read unset after the close is a success; unreadable is not.
    assert after_close(False) is JobEnd.SUCCEEDED
    assert after_close(True) is JobEnd.FAILED
    assert after_close(None) is JobEnd.UNKNOWN
    assert after_barrier(BarrierEnd.DONE) is JobEnd.SUCCEEDED
    assert after_barrier(BarrierEnd.FAILED) is JobEnd.FAILED
    assert after_barrier(BarrierEnd.TIMED_OUT) is JobEnd.UNKNOWN
    assert after_barrier(BarrierEnd.RESTART) is None


def test_an_exit_barrier_nobody_else_reaches_times_out() -> None:
    store = LocalStore()
    t0 = time.monotonic()
    assert exit_barrier(store, 0, 2, 0.5, lambda: []) is BarrierEnd.TIMED_OUT
    assert time.monotonic() - t0 < 5
    # the missing member found gone: nobody left to wait for
    assert exit_barrier(LocalStore(), 0, 2, 5.0, lambda: ["n1"]) is BarrierEnd.DONE


class ClosedHandler(LocalRendezvousHandler):
    """A node that never ran workers: the job closes before it holds a round."""

    def __init__(self, run_id: str, failed: bool) -> None:
        super().__init__(run_id)
        if failed:
            self.store.set(FAILED_KEY, "1")

    def next_rendezvous(self) -> RendezvousInfo:
        raise RendezvousClosedError("closed")


class NoJobStoreHandler(ClosedHandler):
    def read_job_store(self) -> None:
        return None


@pytest.mark.parametrize(
    ("handler", "code"),
    [
        (ClosedHandler("job", failed=False), 0),
        (ClosedHandler("job", failed=True), 1),  # no record to name a root cause: 1
        (NoJobStoreHandler("job", failed=False), 1),  # cannot tell: never 0
    ],
)
def test_a_node_that_never_ran_reads_how_the_job_ended(
    tmp_path: Path, handler: ClosedHandler, code: int
) -> None:
    spec = make_spec(handler, ("-c", "pass"), 1)
    result = LocalElasticAgent(spec).run()
    assert result.exit_code == code, result
    assert (result.state is WorkerState.SUCCEEDED) == (code == 0)


def test_a_timed_out_exit_barrier_is_not_a_success(tmp_path: Path) -> None:
    """Two agents: node0's workers finish at once, node1's run on past node0's barrier
    timeout (1 s). node0 cannot tell how the job ends: exit 1, not 0; node1 finds node0
    counted at the barrier and exits 0."""
    worker = script(
        tmp_path,
        "w.py",
        """
        import os, time
        time.sleep(0.2 if os.environ["GROUP_RANK"] == "0" else 4.0)
        """,
    )
    shared = SharedRendezvous(2)
    results: list[Any] = [None, None]

    def node(i: int) -> None:
        spec = make_spec(NodeHandler(shared, f"node{i}"), ("-u", worker), 1)
        results[i] = LocalElasticAgent(spec, exit_barrier_timeout=1.0).run()

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(r, RunResult) for r in results)
    first, second = results
    assert first.exit_code == 1 and first.state is WorkerState.FAILED, first
    assert "exit barrier" in first.message and "not a success" in first.message
    assert second.exit_code == 0, second


STANDBY_WORKER = """
import os, sys, time
out = sys.argv[1]
open(os.path.join(out, "started_" + os.environ["GROUP_RANK"]), "w").close()
while not os.path.exists(os.path.join(out, "fail")):
    time.sleep(0.05)
sys.exit(3 if os.environ["GROUP_RANK"] == "1" else 0)
"""
CONF = "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=1"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_standby_of_a_full_job_exits_with_the_jobs_failure(
    procs: Processes, port: int, tmp_path: Path
) -> None:
    """A full ``--nnodes=2`` job and a third agent waiting as its standby (it never runs
    a worker). One worker exits 3 with no restart left: every node exits 3, the standby
    too, with the job's root cause."""
    worker = script(tmp_path, "w.py", STANDBY_WORKER)
    out = tmp_path / "out"
    out.mkdir()

    def agent() -> Any:
        return procs.elastic(
            "run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=codes",
            f"--rdzv-conf={CONF}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            worker,
            str(out),
        )

    members = [agent(), agent()]
    started = lambda: {p.name for p in out.iterdir()} >= {"started_0", "started_1"}  # noqa: E731
    assert wait_until(started, 60), [p.communicate()[1] for p in members]
    standby = agent()
    time.sleep(3.0)  # it joins and waits for a next round that never forms
    assert standby.poll() is None
    assert sorted(os.listdir(out)) == ["started_0", "started_1"]  # it ran no worker
    (out / "fail").touch()
    codes = []
    for proc in [*members, standby]:
        proc.wait(timeout=60)
        codes.append(proc.returncode)
    errs = [p.communicate()[1] for p in [*members, standby]]
    assert codes == [3, 3, 3], f"{codes}\n" + "\n---\n".join(errs)
