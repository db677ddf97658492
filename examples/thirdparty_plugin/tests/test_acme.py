"""elastic-acme's own tests, written with the fixtures elastic installs for plugin
authors (``elastic_agent_runner``, ``elastic_conformance``): nothing to configure."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from elastic.testing.conformance import RendezvousTarget
from elastic_acme.report import AcmeReport

# c10d settings that make a conformance round quick (the acme backend passes them on).
QUICK = {
    "last_call_timeout": "1",
    "heartbeat_interval": "0.5",
    "heartbeat_timeout": "3",
    "close_timeout": "2",
    "join_timeout": "60",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_report_of_a_real_run(elastic_agent_runner, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os\nassert os.environ['ACME_JOB_ID']\n")
    report = tmp_path / "report.json"
    run = elastic_agent_runner.run(
        str(script), nproc=2, plugins=[AcmeReport], options={"acme_report": str(report)}
    )
    assert run.exit_code == 0
    assert run.hook_names == [
        "elastic_addoption",
        "elastic_agent_start",
        "elastic_worker_env",
        "elastic_rendezvous_complete",
        "elastic_workers_started",
        "elastic_run_end",
    ]
    assert run.spec.extra_env["ACME_JOB_ID"] == run.config.run_id
    data = json.loads(report.read_text())
    assert data["state"] == "SUCCEEDED" and data["exit_code"] == 0
    assert data["rounds"] == [{"round": 0, "rank": 0, "world_size": 1}]


def test_failures_are_reported(elastic_agent_runner, tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    report = tmp_path / "report.json"
    # By entry point name: the installed plugin, exactly as `elastic run` loads it.
    run = elastic_agent_runner.run(
        str(script), plugins=["acme-report"], options={"acme_report": str(report)}
    )
    assert run.exit_code == 3
    data = json.loads(report.read_text())
    assert data["state"] == "FAILED"
    assert data["failures"] == [{"rank": 0, "exit_code": 3}]


def test_acme_backend_conforms(elastic_conformance) -> None:
    target = RendezvousTarget("acme", f"127.0.0.1:{free_port()}", dict(QUICK))
    report = elastic_conformance(target)
    report.assert_passed()
    assert "test_fixed_size_round" in report.passed
