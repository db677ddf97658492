"""No agent imports torch, on any backend: each agent of a real two-node job (and
``elastic status`` afterwards) records, as it exits, whether ``torch`` is in its
``sys.modules``. Workers are trivial scripts that never import torch either, so any
``torch`` found was imported by the agent itself. And the package installs and runs a
job in a venv where torch cannot be imported at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from elastic.harness.commands import REPO, cli_env
from elastic.harness.installed_copy import copy_tracked
from elastic.testing.ports import free_port

pytest_plugins = ["elastic.testing.etcd"]

# Runs the real CLI (``python -m elastic``) and, at interpreter exit, writes the
# torch-related modules this process imported to the file named in argv[1].
BOOT = """\
import atexit, json, runpy, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(
    sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))))
sys.argv = ["elastic", *sys.argv[2:]]
runpy.run_module("elastic", run_name="__main__", alter_sys=True)
"""

WORKER = """\
import json, os, sys
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK")}, f)
"""


def _nodes_flags(backend: str, endpoint: str, rank: int, run_id: str) -> list[str]:
    if backend == "static":
        host, port = endpoint.split(":")
        return [f"--node-rank={rank}", f"--master-addr={host}", f"--master-port={port}"]
    return [
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=last_call_timeout=0.5",
    ]


def _run_job(procs: Any, tmp_path: Path, backend: str, endpoint: str, run_id: str) -> None:
    boot = tmp_path / "boot.py"
    boot.write_text(BOOT)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = cli_env({"RES_OPTIONS": "timeout:1 attempts:1"})
    agents = [
        procs.start(
            [
                sys.executable,
                str(boot),
                str(tmp_path / f"agent{rank}.modules"),
                "run",
                "--nnodes=2",
                "--nproc-per-node=1",
                *_nodes_flags(backend, endpoint, rank, run_id),
                str(worker),
                str(out),
            ],
            env=env,
        )
        for rank in (0, 1)
    ]
    outputs = [agent.communicate(timeout=90) for agent in agents]
    report = "\n".join(
        f"agent {rank} (exit {agent.returncode}):\n{out}\n{err}"
        for rank, (agent, (out, err)) in enumerate(zip(agents, outputs, strict=True))
    )
    assert [agent.returncode for agent in agents] == [0, 0], report
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["WORLD_SIZE"] for r in records} == {"2"}
    for rank in (0, 1):
        modules = json.loads((tmp_path / f"agent{rank}.modules").read_text())
        assert modules == [], f"agent {rank} ({backend}) imported {modules[:5]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_agents_on_loopback_backends_never_import_torch(
    procs: Any, tmp_path: Path, backend: str
) -> None:
    _run_job(procs, tmp_path, backend, f"127.0.0.1:{free_port()}", f"notorch-{backend}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["etcd-v3", "etcd-v2", "etcd"])
def test_agents_and_status_on_etcd_backends_never_import_torch(
    procs: Any, tmp_path: Path, backend: str, etcd_server_shared: Any
) -> None:
    run_id = f"notorch-{backend}"
    _run_job(procs, tmp_path, backend, etcd_server_shared.endpoint, run_id)
    status = procs.start(
        [
            sys.executable,
            str(tmp_path / "boot.py"),
            str(tmp_path / "status.modules"),
            "status",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={etcd_server_shared.endpoint}",
            f"--rdzv-id={run_id}",
        ]
    )
    stdout, stderr = status.communicate(timeout=60)
    assert status.returncode == 0, stdout + stderr
    assert run_id in stdout
    assert json.loads((tmp_path / "status.modules").read_text()) == []


# --- installed where there is no torch ------------------------------------------------------

# In the venv's site-packages: every process of the venv (pip, the agent, its workers)
# starts with torch unimportable, though the venv sees the system's packages (so pip
# needs nothing from an index but our own wheel: no network).
HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"

TORCHLESS_WORKER = """\
import importlib.util, json, os, sys
try:
    import torch
except ImportError:
    torch = None
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"torch": torch is not None, "world": os.environ["WORLD_SIZE"],
               "master": os.environ["MASTER_ADDR"]}, f)
"""


@pytest.fixture(scope="module")
def torchless_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv where torch cannot be imported, with elastic-launch installed into it by
    pip from a wheel of this checkout (``--no-index``: its dependencies must already be
    there, which click and pluggy are, from the system's packages)."""
    root = tmp_path_factory.mktemp("torchless")
    wheels, venv = root / "wheels", root / "venv"
    source = copy_tracked(REPO, root / "source")  # not in the checkout: no build/ left there
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(wheels), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
        check=True,
        timeout=120,
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    (Path(site) / "hide_torch.pth").write_text(HIDE_TORCH)
    (wheel,) = wheels.glob("elastic_launch-*.whl")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
        + ["--no-index", "--find-links", str(wheels), "--ignore-installed", "--no-deps"]
        + [str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return venv


def in_venv(venv: Path, *cmd: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        [str(venv / "bin" / cmd[0]), *cmd[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_installed_without_torch_a_standalone_job_runs(torchless_venv: Path, tmp_path: Path):
    check = in_venv(
        torchless_venv,
        "python",
        "-c",
        "import importlib.metadata as md, importlib.util, elastic; "
        "print(elastic.__file__); print(md.requires('elastic-launch')); "
        "print(importlib.util.find_spec('torch'))",
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr
    where, requires, torch_spec = check.stdout.splitlines()
    assert where.startswith(str(torchless_venv)), where  # the installed copy, not this tree
    assert "torch" not in requires and torch_spec == "None", check.stdout
    (tmp_path / "worker.py").write_text(TORCHLESS_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    run = in_venv(
        torchless_venv,
        "elastic",
        "run",
        "--standalone",
        "--nproc-per-node=2",
        "worker.py",
        str(out),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert records == [{"torch": False, "world": "2", "master": records[0]["master"]}] * 2
    listed = in_venv(torchless_venv, "elastic", "plugins", "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "c10d" in listed.stdout
