"""Under ``srun`` on two simulated hosts (issue 26): each host runs
``elastic run --nproc-per-node=1 script`` with nothing but what srun gives its task (the
job and step ids, the step's node count, this node's id and the step's compressed
nodelist naming both hosts), and the two form ONE job of world size 2: the workers see
WORLD_SIZE=2, their RANKs follow SLURM_NODEID, one gloo all_reduce spans both hosts, and
both agents exit 0. The hosts are ``cluster_factory`` network namespaces with their own
names and addresses, so the first host of the nodelist really is another machine's name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic.harness.cluster import Cluster
from elastic.harness.multihost import name_mapped_addresses
from elastic.harness.records import RANK_RECORD_WORKER

pytestmark = pytest.mark.slow

Make = Callable[..., Cluster]

JOB_ID = "4242"


def compressed(names: list[str]) -> str:
    """The hosts' names as SLURM writes them: ``node[0-1]-<pid>c<n>``."""
    prefix, suffixes = "node", [name.removeprefix("node").split("-", 1) for name in names]
    assert all(rest == suffixes[0][1] for _, rest in suffixes), names
    return f"{prefix}[{suffixes[0][0]}-{suffixes[-1][0]}]-{suffixes[0][1]}"


def srun_task_env(node_id: int, nodelist: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOBID=JOB_ID,
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST=nodelist,
        SLURM_STEP_ID="0",
        SLURM_STEPID="0",
        SLURM_STEP_NUM_NODES="2",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NODELIST=nodelist,
        SLURM_NNODES="2",
        SLURM_NTASKS="2",
        SLURM_NODELIST=nodelist,
        SLURM_NODEID=str(node_id),
        SLURM_PROCID=str(node_id),
        SLURM_LOCALID="0",
    )
    return env


@pytest.mark.timeout(150)
def test_two_srun_tasks_form_one_job(cluster_factory: Make, tmp_path: Path) -> None:
    cluster = cluster_factory(2)
    name_mapped_addresses(cluster)
    nodelist = compressed([h.name for h in cluster.hosts])
    script = tmp_path / "worker.py"
    script.write_text(RANK_RECORD_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "elastic", "run", "--nproc-per-node=1", str(script), str(out)]
    procs = {
        host.name: host.popen(
            cmd,
            env=srun_task_env(host.index, nodelist),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for host in reversed(cluster.hosts)  # the store's host last: the other waits for it
    }
    outputs = {name: proc.communicate(timeout=120)[0] for name, proc in procs.items()}
    log = "\n".join(f"--- {name}\n{text[-3000:]}" for name, text in outputs.items())
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{log}"
    first = cluster.hosts[0].name
    for host in cluster.hosts:
        took = (
            f"elastic: from SLURM job {JOB_ID} step 0: --nnodes=2 --node-rank={host.index} "
            f"--rdzv-backend=c10d --rdzv-endpoint={first}:{15000 + int(JOB_ID)} "
            f"--rdzv-id={JOB_ID}.0"
        )
        assert outputs[host.name].splitlines()[0] == took, log
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert [(r["rank"], r["world"], r["host"]) for r in records] == [
        (0, 2, cluster.hosts[0].name),
        (1, 2, cluster.hosts[1].name),
    ], log
    assert {r["run_id"] for r in records} == {f"{JOB_ID}.0"}
    assert {r["sum"] for r in records} == {3.0}  # one all_reduce across both hosts
