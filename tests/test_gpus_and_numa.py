"""AMD GPUs counted from the KFD topology (``--nproc-per-node=gpu``/``auto``) and
``--numa-binding``: on a fake sysfs tree (two NUMA nodes, two AMD GPUs) through the real
CLI, and on this machine's own topology, where each worker's CPU affinity is read back
from the worker and the agent's is checked unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from elastic.core.workers import numa
from elastic.core.workers.devices import count_gpus
from elastic.harness.commands import run_elastic, write_script

CPU_NODE = "cpu_cores_count 2\nsimd_count 0\nlocation_id 0\ndomain 0\n"


def gpu_node(bus: int) -> str:
    # location_id: bus << 8 | device << 3 | function
    return f"cpu_cores_count 0\nsimd_count 256\nlocation_id {bus << 8}\ndomain 0\n"


def fake_sysfs(root: Path) -> Path:
    """KFD nodes 0 (CPU), 1 (GPU at 0000:c1:00.0, NUMA node 1), 2 (GPU at 0000:41:00.0,
    NUMA node 0); NUMA node 0 holds CPU 0 (socket 0), node 1 CPU 1 (socket 1)."""
    files = {
        "class/kfd/kfd/topology/nodes/0/properties": CPU_NODE,
        "class/kfd/kfd/topology/nodes/1/properties": gpu_node(0xC1),
        "class/kfd/kfd/topology/nodes/2/properties": gpu_node(0x41),
        "bus/pci/devices/0000:c1:00.0/numa_node": "1\n",
        "bus/pci/devices/0000:41:00.0/numa_node": "0\n",
        "devices/system/node/possible": "0-1\n",
        "devices/system/node/node0/cpulist": "0\n",
        "devices/system/node/node1/cpulist": "1\n",
    }
    for cpu in (0, 1):
        topo = f"devices/system/cpu/cpu{cpu}/topology"
        files[f"{topo}/physical_package_id"] = f"{cpu}\n"
        files[f"{topo}/thread_siblings_list"] = f"{cpu}\n"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return fake_sysfs(tmp_path / "sys")


def dry_run_nproc(value: str, env: dict[str, str], tmp_path: Path) -> tuple[int, str]:
    script = write_script(tmp_path, "w.py", "pass\n")
    clean = {k: "" for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ}
    proc = run_elastic(
        "run",
        "--standalone",
        "--dry-run",
        f"--nproc-per-node={value}",
        script,
        env={**clean, **env},
    )
    if proc.returncode != 0:
        return proc.returncode, proc.stderr.strip()
    (line,) = [ln for ln in proc.stdout.splitlines() if "nproc per node" in ln]
    return 0, line.split(":")[1].strip()


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ({}, "2"),
        ({"ROCR_VISIBLE_DEVICES": "1"}, "1"),
        ({"HIP_VISIBLE_DEVICES": "0,1"}, "2"),
        ({"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "1"}, "1"),
        ({"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1"}, "none"),  # HIP indexes ROCr's
        ({"HIP_VISIBLE_DEVICES": "-1"}, "none"),
    ],
)
def test_gpu_counts_rocm_devices_from_the_kfd_topology(
    sysfs: Path, tmp_path: Path, visible: dict[str, str], expected: str
) -> None:
    env = {"ELASTIC_SYSFS_ROOT": str(sysfs), **visible}
    code, out = dry_run_nproc("gpu", env, tmp_path)
    if expected == "none":
        assert code == 2 and "'gpu' was asked for but this machine has no visible GPU" in out
    else:
        assert (code, out) == (0, expected)
    assert count_gpus(env) == (0 if expected == "none" else int(expected))


def test_auto_counts_rocm_gpus_before_cpus(sysfs: Path, tmp_path: Path) -> None:
    assert dry_run_nproc("auto", {"ELASTIC_SYSFS_ROOT": str(sysfs)}, tmp_path) == (0, "2")
    cpus = str(len(os.sched_getaffinity(0)))
    no_gpu = {"ELASTIC_SYSFS_ROOT": str(tmp_path / "empty")}
    assert dry_run_nproc("auto", no_gpu, tmp_path) == (0, cpus)


def test_a_cpu_only_kfd_node_is_no_gpu(sysfs: Path) -> None:
    for node in (1, 2):
        (sysfs / f"class/kfd/kfd/topology/nodes/{node}/properties").write_text(CPU_NODE)
    assert count_gpus({"ELASTIC_SYSFS_ROOT": str(sysfs)}) == 0


def test_the_plan_follows_each_gpus_numa_node(sysfs: Path) -> None:
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("this agent may not use CPUs 0 and 1")
    env = {"ELASTIC_SYSFS_ROOT": str(sysfs)}
    # GPU 0 sits on NUMA node 1 (CPU 1), GPU 1 on node 0 (CPU 0).
    assert numa.plan("node", 2, env) == [{1}, {0}]
    assert numa.plan("socket", 2, env) == [{1}, {0}]
    assert numa.plan("exclusive", 2, env) == [{1}, {0}]
    assert numa.plan("node", 1, {**env, "HIP_VISIBLE_DEVICES": "1"}) == [{0}]
    with pytest.raises(numa.NumaBindingError, match="3 workers but 2 visible GPUs"):
        numa.plan("node", 3, env)
    (sysfs / "bus/pci/devices/0000:41:00.0/numa_node").unlink()
    with pytest.raises(numa.NumaBindingError, match="0000:41:00.0"):
        numa.plan("node", 2, env)


REPORT = """
import json, os, sys
rank = os.environ["LOCAL_RANK"]
with open(os.path.join(sys.argv[1], rank + ".json"), "w") as f:
    json.dump({"mine": sorted(os.sched_getaffinity(0)),
               "agent": sorted(os.sched_getaffinity(os.getppid()))}, f)
"""


def bound_workers(tmp_path: Path, flags: list[str], env: dict[str, str]) -> dict[int, dict]:
    script = write_script(tmp_path, "report.py", REPORT)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_elastic("run", "--standalone", *flags, script, str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.mark.timeout(120)
def test_each_worker_is_bound_near_its_gpu_and_the_agent_is_not(
    sysfs: Path, tmp_path: Path
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if not {0, 1} <= set(allowed):
        pytest.skip("this agent may not use CPUs 0 and 1")
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # HIP reads it too: it would pick the GPUs
        pytest.skip("CUDA_VISIBLE_DEVICES is set")
    env = {"ELASTIC_SYSFS_ROOT": str(sysfs)}
    seen = bound_workers(tmp_path, ["--nproc-per-node=gpu", "--numa-binding=node"], env)
    assert {r: s["mine"] for r, s in seen.items()} == {0: [1], 1: [0]}
    assert all(s["agent"] == allowed for s in seen.values())


def this_nodes_cores() -> list[set[int]]:
    """Node 0's physical cores this process may use, read here from sysfs (not by the
    code under test), each as its hyperthreads."""
    sys_node = Path("/sys/devices/system/node/node0/cpulist")
    cpus = numa.parse_cpu_list(sys_node.read_text()) & os.sched_getaffinity(0)
    cores: dict[int, set[int]] = {}
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.setdefault(min(numa.parse_cpu_list(siblings.read_text())), set()).add(cpu)
    return [cores[k] for k in sorted(cores)]


@pytest.mark.timeout(120)
def test_exclusive_binding_on_this_machine(tmp_path: Path) -> None:
    """No GPU here: the two workers share NUMA node 0 and get one half of its cores each."""
    cores = this_nodes_cores()
    if len(cores) < 2:
        pytest.skip("node 0 has fewer than 2 physical cores this process may use")
    half = len(cores) // 2 + len(cores) % 2
    expected = {0: sorted(set().union(*cores[:half])), 1: sorted(set().union(*cores[half:]))}
    env = {"CUDA_VISIBLE_DEVICES": ""}
    seen = bound_workers(tmp_path, ["--nproc-per-node=2", "--numa-binding=exclusive"], env)
    assert {r: s["mine"] for r, s in seen.items()} == expected
    allowed = sorted(os.sched_getaffinity(0))
    assert all(s["agent"] == allowed for s in seen.values())  # the agent is not bound
    assert expected[0] != allowed  # so the check above could fail


@pytest.mark.timeout(60)
def test_a_binding_this_node_cannot_give_is_one_line(tmp_path: Path) -> None:
    script = write_script(tmp_path, "w.py", "pass\n")
    nproc = len(this_nodes_cores()) + 1
    proc = run_elastic(
        "run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--numa-binding=exclusive",
        script,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"physical cores for {nproc} workers" in lines[0]
