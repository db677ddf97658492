"""The third-party package of docs/plugins.md (examples/thirdparty_plugin), installed by
pip into a temporary target and used for real: listed by ``elastic plugins list``, its
option in ``elastic run --help``, a two-node job on its backend with its report, and its
own test suite, written with our pytest fixtures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from elastic.harness.commands import REPO, cli_env, run_elastic
from elastic.harness.processes import Processes

pytestmark = pytest.mark.slow

WORKER = """
import os
print("worker", os.environ["RANK"], "of", os.environ["WORLD_SIZE"],
      "job", os.environ["ACME_JOB_ID"], flush=True)
"""


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the example's sources, the pip target it is installed into)."""
    source = tmp_path_factory.mktemp("acme-src") / "thirdparty_plugin"
    shutil.copytree(REPO / "examples" / "thirdparty_plugin", source)  # pip builds in place
    target = tmp_path_factory.mktemp("acme-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--target", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return source, target


def test_listed_with_its_option(example: tuple[Path, Path]) -> None:
    env = {"PYTHONPATH": str(example[1])}
    listed = run_elastic("plugins", "list", "--json", env=env, timeout=60)
    records = {(r["group"], r["name"]): r for r in json.loads(listed.stdout)}
    for key in [("elastic.rendezvous", "acme"), ("elastic.plugins", "acme-report")]:
        assert records[key]["distribution"] == "elastic-acme", records[key]
        assert records[key]["status"] == "ok", records[key]
    assert records[("elastic.plugins", "acme-report")]["hooks"] == [
        "elastic_addoption",
        "elastic_agent_start",
        "elastic_rendezvous_complete",
        "elastic_run_end",
        "elastic_worker_env",
        "elastic_worker_failed",
    ]
    helped = run_elastic("run", "--help", env=env, timeout=60)
    assert "Options from plugin 'acme-report':" in helped.stdout
    assert "--acme-report, --acme_report PATH" in helped.stdout


def test_two_nodes_on_the_acme_backend(
    example: tuple[Path, Path], tmp_path: Path, port: int, procs: Processes
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = cli_env(
        {
            "PYTHONPATH": str(example[1]),
            "ACME_COORDINATOR": f"127.0.0.1:{port}",
            "ACME_JOB_ID": "acme-42",
            "OMP_NUM_THREADS": "1",
        }
    )
    nodes = [
        procs.elastic(
            "run",
            "--rdzv-backend=acme",
            "--nnodes=2",
            f"--acme-report={tmp_path / f'report{i}.json'}",
            str(script),
            env=env,
        )
        for i in range(2)
    ]
    outputs = [node.communicate(timeout=120) for node in nodes]
    for node, (_out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err
    printed = sorted(line for out, _ in outputs for line in out.splitlines())
    assert printed == ["worker 0 of 2 job acme-42", "worker 1 of 2 job acme-42"]
    reports = [json.loads((tmp_path / f"report{i}.json").read_text()) for i in range(2)]
    assert [r["run_id"] for r in reports] == ["acme-42", "acme-42"]
    assert sorted(r["rounds"][0]["rank"] for r in reports) == [0, 1]
    assert {r["rounds"][0]["world_size"] for r in reports} == {2}
    assert {r["state"] for r in reports} == {"SUCCEEDED"}


def test_the_example_test_suite_passes(example: tuple[Path, Path]) -> None:
    source, target = example
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=source,
        env=cli_env({"PYTHONPATH": str(target)}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout
