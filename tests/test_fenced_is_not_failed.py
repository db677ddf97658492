"""A node fenced by its own lease stops its workers itself (``core/agent/fence.py``):
their deaths by that SIGTERM are the fence's doing, not a failure of theirs. When the
store answers again by the time the agent looks at those exits (a store paused longer
than the lease, not a cut cable), the agent must still take them for a fence: rejoin,
spend no restart and publish no failure (with ``--max-restarts=0`` a published failure
would end the job on every node). Real agents on loopback, a real etcd SIGSTOPped for
longer than the lease (4 s) and shorter than etcd's own lease TTL (10 s)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from elastic.harness.commands import write_script as script
from elastic.harness.processes import Processes
from elastic.testing.etcd import EtcdCluster
from elastic.testing.waits import wait_until

pytest_plugins = ["elastic.testing.etcd"]
pytestmark = pytest.mark.slow

PAUSE = 7.0  # s etcd stays stopped: past the lease (4 s with the defaults), within its TTL

WORKER = """
import os, sys, time
out = sys.argv[1]
open(os.path.join(out, f"start_{os.environ['GROUP_RANK']}_{os.getpid()}"), "w").close()
while not os.path.exists(os.path.join(out, "stop")):
    time.sleep(0.02)
"""


@pytest.mark.timeout(150)
def test_a_store_paused_past_the_lease_fences_and_the_job_goes_on(
    procs: Processes, tmp_path: Path, etcd_v3_server: EtcdCluster
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    worker = script(tmp_path, "w.py", WORKER)
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    agents = []
    for log in logs:
        with open(log, "w") as f:
            agents.append(
                procs.elastic(
                    "run",
                    "--nnodes=2",
                    "--nproc-per-node=1",
                    "--rdzv-backend=etcd-v3",
                    f"--rdzv-endpoint={etcd_v3_server.endpoint}",
                    "--rdzv-id=fenced",
                    "--max-restarts=0",
                    "--monitor-interval=0.1",
                    worker,
                    str(out),
                    stdout=f,
                    stderr=f,
                )  # fmt: skip
            )

    def texts() -> str:
        return "\n---\n".join(log.read_text() for log in logs)

    def starts() -> list[str]:
        return [n for n in os.listdir(out) if n.startswith("start_")]

    assert wait_until(lambda: len(starts()) == 2, 60), texts()
    first = set(starts())
    etcd = etcd_v3_server.members[0].proc
    etcd.send_signal(signal.SIGSTOP)
    try:
        time.sleep(PAUSE)
    finally:
        etcd.send_signal(signal.SIGCONT)
    # Both nodes fenced (neither could keep its lease): each rejoins with new workers.
    assert wait_until(lambda: len(set(starts()) - first) == 2, 60), texts()
    (out / "stop").touch()
    codes = [a.wait(timeout=60) for a in agents]
    assert codes == [0, 0], texts()
    for log in logs:
        text = log.read_text()
        assert "cannot reach the rendezvous store" in text, texts()
        assert "failed" not in text.lower(), texts()  # no failure said, none published
