"""`elastic status` on real running jobs, and mismatched nodes refused at the door."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import Processes, free_port, run_elastic, wait_until

pytestmark = pytest.mark.slow

WORKER = """
import os, time, pathlib
stop = pathlib.Path(os.environ["STOP_FILE"])
print("RANK", os.environ["RANK"], "WS", os.environ["WORLD_SIZE"], flush=True)
while not stop.exists():
    time.sleep(0.1)
"""
FAST_ROUNDS = "last_call_timeout=1,heartbeat_interval=0.5,heartbeat_timeout=3"


@pytest.fixture
def job(tmp_path: Path, procs: Processes):
    """Starts agents of one c10d job; the test writes STOP_FILE to end it."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    endpoint = f"127.0.0.1:{free_port()}"
    env_stop = {"STOP_FILE": str(tmp_path / "stop")}

    def start(*extra: str, nnodes: str = "2:3", nproc: int = 1, path: Path = script):
        import os

        return procs.elastic(
            "run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=statusjob",
            *extra,
            str(path),
            env={**os.environ, **env_stop},
        )

    start.endpoint = endpoint  # type: ignore[attr-defined]
    start.script = script  # type: ignore[attr-defined]
    yield start
    (tmp_path / "stop").write_text("")


def try_status(endpoint: str, run_id: str = "statusjob") -> dict | None:
    result = run_elastic(
        "status",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--json",
        timeout=30,
    )
    return json.loads(result.stdout) if result.returncode == 0 else None


def status(endpoint: str, run_id: str = "statusjob") -> dict:
    seen = try_status(endpoint, run_id)
    assert seen is not None
    return seen


def wait_for_members(endpoint: str, count: int, timeout: float = 90) -> dict:
    seen: dict = {}

    def formed() -> bool:
        seen.update(try_status(endpoint) or {})  # the host may not be listening yet
        return seen.get("state") == "running" and len(seen["members"]) == count

    assert wait_until(formed, timeout=timeout, interval=0.5), seen
    return seen


def test_status_lists_members_and_follows_a_killed_node(job) -> None:
    host = job("--rdzv-conf", FAST_ROUNDS)
    job("--rdzv-conf", FAST_ROUNDS)
    third = job("--rdzv-conf", FAST_ROUNDS)
    first = wait_for_members(job.endpoint, 3)
    assert first["schema"] == 1 and first["run_id"] == "statusjob"
    assert sorted(m["rank"] for m in first["members"]) == [0, 1, 2]
    assert all(m["versions"].get("torch") for m in first["members"])
    assert all(m["heartbeat_age"] is not None and m["heartbeat_age"] < 10 for m in first["members"])
    assert (first["min_nodes"], first["max_nodes"]) == (2, 3)

    text = run_elastic("status", "--rdzv-endpoint", job.endpoint, "--rdzv-id=statusjob")
    assert text.returncode == 0, text.stderr
    assert "job statusjob (c10d): running" in text.stdout
    assert "RANK" in text.stdout and "HEARTBEAT" in text.stdout

    third.send_signal(signal.SIGKILL)
    after = wait_for_members(job.endpoint, 2)
    assert after["round"] > first["round"]
    assert host.poll() is None


def test_status_of_an_unknown_job_is_one_line(job) -> None:
    job("--rdzv-conf", FAST_ROUNDS)
    job("--rdzv-conf", FAST_ROUNDS)
    wait_for_members(job.endpoint, 2)
    result = run_elastic(
        "status", f"--rdzv-endpoint={job.endpoint}", "--rdzv-id=nosuchjob", timeout=30
    )
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "no job with id 'nosuchjob'" in line


def test_status_of_an_unreachable_endpoint_is_one_line() -> None:
    result = run_elastic(
        "status", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=x", timeout=60
    )
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_mismatched_nodes_are_refused_and_allowed_on_purpose(job, tmp_path: Path) -> None:
    job("--rdzv-conf", FAST_ROUNDS)
    job("--rdzv-conf", FAST_ROUNDS)
    before = wait_for_members(job.endpoint, 2)

    wrong_nproc = job("--rdzv-conf", FAST_ROUNDS, nproc=2)
    _, err = wrong_nproc.communicate(timeout=60)
    assert wrong_nproc.returncode == 2, err
    refusal = [ln for ln in err.splitlines() if "refused" in ln]
    assert refusal and "nproc_per_node: job has '1', this node has '2'" in refusal[0]

    patched = tmp_path / "patched" / "worker.py"
    patched.parent.mkdir()
    patched.write_text(job.script.read_text() + "# hotfix\n")
    wrong_script = job("--rdzv-conf", FAST_ROUNDS, path=patched)
    _, err = wrong_script.communicate(timeout=60)
    assert wrong_script.returncode == 2, err
    assert "script_sha256: job has" in err
    assert "entrypoint" in err  # another path is another entrypoint

    during = status(job.endpoint)
    assert during["round"] == before["round"] and len(during["members"]) == 2

    allowed = job(
        "--rdzv-conf", f"{FAST_ROUNDS},allow_mismatch=script_sha256,entrypoint", path=patched
    )
    wait_for_members(job.endpoint, 3)
    assert allowed.poll() is None
