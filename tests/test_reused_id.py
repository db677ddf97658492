"""A finished job's run id, given to a new job on a store that outlives jobs (etcd): the
new job's agents stop at once with one line naming the id, never exit 0 having run
nothing. A node of the finished job that is merely late still exits 0 (test_rdzv_c10d)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from elastic.harness.commands import cli_env

pytest_plugins = ["elastic.testing.etcd"]

WORKER = """
import os, sys
open(os.path.join(sys.argv[1], "ran.%s.%s" % (sys.argv[2], os.environ["RANK"])), "w").close()
"""


def run_job(procs: Any, tmp_path: Path, endpoint: str, attempt: str) -> list[tuple[int, str]]:
    """Two agents of job ``reused`` on etcd-v3; (exit code, stderr) of each."""
    env = cli_env({"RES_OPTIONS": "timeout:1 attempts:1"})
    flags = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=reused",
        "--rdzv-conf=last_call_timeout=0.5",
    ]
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    agents = [
        procs.elastic("run", *flags, str(worker), str(tmp_path), attempt, env=env) for _ in range(2)
    ]
    return [(a.wait(timeout=90), a.communicate(timeout=10)[1]) for a in agents]


@pytest.mark.timeout(200)
def test_a_reused_run_id_is_one_line_and_a_failure(
    procs: Any, tmp_path: Path, etcd_v3_server: Any
) -> None:
    first = run_job(procs, tmp_path, etcd_v3_server.endpoint, "first")
    assert [code for code, _ in first] == [0, 0], first
    assert sorted(p.name for p in tmp_path.glob("ran.first.*")) == ["ran.first.0", "ran.first.1"]

    second = run_job(procs, tmp_path, etcd_v3_server.endpoint, "second")
    for code, err in second:
        assert code != 0, err
        lines = [line for line in err.splitlines() if "--rdzv-id=reused" in line]
        assert len(lines) == 1, err
        assert "already finished" in lines[0] and "new --rdzv-id" in lines[0], err
        assert "Traceback" not in err, err
    assert not list(tmp_path.glob("ran.second.*"))  # nothing ran, and it said so
