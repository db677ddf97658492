"""`elastic status` on real running jobs, and mismatched nodes refused at the door."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from elastic.harness.commands import run_elastic
from elastic.harness.processes import Processes
from elastic.testing.etcd import EtcdCluster
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until

pytestmark = pytest.mark.slow

WORKER = """
import os, time, pathlib
stop = pathlib.Path(os.environ["STOP_FILE"])
print("RANK", os.environ["RANK"], "WS", os.environ["WORLD_SIZE"], flush=True)
while not stop.exists():
    time.sleep(0.1)
"""
FAST_ROUNDS = {
    "c10d": "last_call_timeout=1,heartbeat_interval=0.5,heartbeat_timeout=3",
    "etcd-v2": "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
}


@dataclass
class Job:
    backend: str
    endpoint: str
    script: Path
    fast: str
    start: Callable[..., subprocess.Popen[str]]

    def __call__(self, *extra: str, nproc: int = 1, path: Path | None = None):
        return self.start(*extra, nproc=nproc, path=path or self.script)


@pytest.fixture(params=["c10d", "etcd-v2"])
def job(request: pytest.FixtureRequest, tmp_path: Path, procs: Processes) -> Iterator[Job]:
    """Starts agents of one 2:3 job; the test writes STOP_FILE to end it."""
    backend = request.param
    cluster = EtcdCluster(1).start() if backend == "etcd-v2" else None
    endpoint = cluster.endpoint if cluster else f"127.0.0.1:{free_port()}"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "STOP_FILE": str(tmp_path / "stop")}

    def start(*extra: str, nproc: int, path: Path) -> subprocess.Popen[str]:
        return procs.elastic(
            "run",
            "--nnodes=2:3",
            f"--nproc-per-node={nproc}",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=statusjob",
            *extra,
            str(path),
            env=env,
        )

    yield Job(backend, endpoint, script, FAST_ROUNDS[backend], start)
    (tmp_path / "stop").write_text("")
    procs.cleanup()
    if cluster:
        cluster.stop()


def try_status(job: Job, run_id: str = "statusjob") -> dict | None:
    result = run_elastic(
        "status",
        f"--rdzv-backend={job.backend}",
        f"--rdzv-endpoint={job.endpoint}",
        f"--rdzv-id={run_id}",
        "--json",
        timeout=30,
    )
    return json.loads(result.stdout) if result.returncode == 0 else None


def status(job: Job, run_id: str = "statusjob") -> dict:
    seen = try_status(job, run_id)
    assert seen is not None
    return seen


def wait_for_members(job: Job, count: int, timeout: float = 90) -> dict:
    seen: dict = {}

    def formed() -> bool:
        seen.update(try_status(job) or {})  # the host may not be listening yet
        return seen.get("state") == "running" and len(seen["members"]) == count

    assert wait_until(formed, timeout=timeout, interval=0.5), seen
    return seen


def host_first(job: Job) -> subprocess.Popen[str]:
    """Start the agent that hosts the c10d store, and only then the others: on loopback
    every agent could bind the endpoint, and the test must not kill the one that won."""
    host = job("--rdzv-conf", job.fast)
    if job.backend == "c10d":
        port = int(job.endpoint.rsplit(":", 1)[1])

        def listening() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        assert wait_until(listening, timeout=30), "the first agent never hosted the store"
    return host


def test_status_lists_members_and_follows_a_killed_node(job) -> None:
    host = host_first(job)
    job("--rdzv-conf", job.fast)
    third = job("--rdzv-conf", job.fast)
    first = wait_for_members(job, 3)
    assert first["schema"] == 1 and first["run_id"] == "statusjob"
    assert sorted(m["rank"] for m in first["members"]) == [0, 1, 2]
    assert all(m["versions"].get("torch") for m in first["members"])
    assert all(m["heartbeat_age"] is not None and m["heartbeat_age"] < 10 for m in first["members"])
    assert (first["min_nodes"], first["max_nodes"]) == (2, 3)

    text = run_elastic(
        "status",
        f"--rdzv-backend={job.backend}",
        f"--rdzv-endpoint={job.endpoint}",
        "--rdzv-id=statusjob",
    )
    assert text.returncode == 0, text.stderr
    assert f"job statusjob ({job.backend}): running" in text.stdout
    assert "RANK" in text.stdout and "HEARTBEAT" in text.stdout

    third.send_signal(signal.SIGKILL)
    after = wait_for_members(job, 2)
    assert after["round"] > first["round"]
    assert host.poll() is None


def test_status_of_an_unknown_job_is_one_line(job) -> None:
    job("--rdzv-conf", job.fast)
    job("--rdzv-conf", job.fast)
    wait_for_members(job, 2)
    result = run_elastic(
        "status",
        f"--rdzv-backend={job.backend}",
        f"--rdzv-endpoint={job.endpoint}",
        "--rdzv-id=nosuchjob",
        timeout=30,
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
    job("--rdzv-conf", job.fast)
    job("--rdzv-conf", job.fast)
    before = wait_for_members(job, 2)

    wrong_nproc = job("--rdzv-conf", job.fast, nproc=2)
    _, err = wrong_nproc.communicate(timeout=60)
    assert wrong_nproc.returncode == 2, err
    refusal = [ln for ln in err.splitlines() if "refused" in ln]
    assert refusal and "nproc_per_node: job has '1', this node has '2'" in refusal[0]

    patched = tmp_path / "patched" / "worker.py"
    patched.parent.mkdir()
    patched.write_text(job.script.read_text() + "# hotfix\n")
    wrong_script = job("--rdzv-conf", job.fast, path=patched)
    _, err = wrong_script.communicate(timeout=60)
    assert wrong_script.returncode == 2, err
    assert "script_sha256: job has" in err
    assert "entrypoint" in err  # another path is another entrypoint

    during = status(job)
    assert during["round"] == before["round"] and len(during["members"]) == 2

    allowed = job(
        "--rdzv-conf", f"{job.fast},allow_mismatch=script_sha256,entrypoint", path=patched
    )
    wait_for_members(job, 3)
    assert allowed.poll() is None


def interruptible() -> None:
    """Run in a watcher's process before it becomes ``elastic``: SIGINT at its default
    disposition, as a terminal's Ctrl-C finds it. A suite started from a background job
    (``cmd &`` in a shell without job control) runs with SIGINT ignored; a child keeps
    that disposition, and Python installs no KeyboardInterrupt for an ignored SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_watcher(job: Job, procs: Processes, **kwargs: object) -> subprocess.Popen[str]:
    """``elastic status --watch`` on the job, ready to be interrupted by SIGINT."""
    return procs.elastic(
        "status",
        f"--rdzv-backend={job.backend}",
        f"--rdzv-endpoint={job.endpoint}",
        "--rdzv-id=statusjob",
        "--watch=0.3",
        preexec_fn=interruptible,
        **kwargs,
    )


def test_watch_redraws_until_interrupted(job: Job, procs: Processes, tmp_path: Path) -> None:
    job("--rdzv-conf", job.fast)
    job("--rdzv-conf", job.fast)
    wait_for_members(job, 2)
    out, err = tmp_path / "watch.out", tmp_path / "watch.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        watcher = start_watcher(job, procs, stdout=stdout, stderr=stderr)
    drawn = f"job statusjob ({job.backend}): running"
    # redrawn, however long a loaded machine takes to start the command
    assert wait_until(lambda: out.read_text().count(drawn) >= 2, timeout=60), err.read_text()
    watcher.send_signal(signal.SIGINT)
    watcher.wait(timeout=30)
    assert watcher.returncode == 130, err.read_text()
    assert "Traceback" not in err.read_text()


def watchers_interrupted(
    job: Job,
    procs: Processes,
    tmp_path: Path,
    count: int,
    delays: tuple[float, float],
    once_drawn: Callable[[], object] = lambda: None,
) -> list[str]:
    """Start ``count`` watchers at once; once each has drawn (and ``once_drawn`` ran),
    SIGINT each after a random delay in ``delays`` (s); what went wrong with each, if
    anything (an exit that is not 130 within a few seconds, or a traceback)."""
    started = []
    for i in range(count):
        out, err = tmp_path / f"watch{i}.out", tmp_path / f"watch{i}.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            proc = start_watcher(job, procs, stdout=stdout, stderr=stderr)
        started.append((proc, out, err, random.uniform(*delays)))
    assert wait_until(lambda: all(o.stat().st_size for _, o, _, _ in started), timeout=90)
    once_drawn()
    drawn = time.monotonic()
    problems = []
    for proc, _out, err, delay in sorted(started, key=lambda s: s[3]):
        time.sleep(max(0.0, drawn + delay - time.monotonic()))
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            problems.append(f"still running 10 s after SIGINT at +{delay:.2f}s")
            continue
        took = time.monotonic() - sent
        text = err.read_text()
        if proc.returncode != 130 or "Traceback" in text or took > 5:
            problems.append(f"+{delay:.2f}s: exit {proc.returncode} after {took:.1f}s: {text}")
    return problems


@pytest.mark.timeout(300)
def test_ctrl_c_ends_watch_wherever_it_lands(job: Job, procs: Processes, tmp_path: Path) -> None:
    """20 SIGINTs at random points of the redraw cycle (the handler being made, a store
    call, the sleep), from 4 watchers at a time (each other's load)."""
    job("--rdzv-conf", job.fast)
    job("--rdzv-conf", job.fast)
    wait_for_members(job, 2)
    problems = []
    for _ in range(5):
        problems += watchers_interrupted(job, procs, tmp_path, 4, (0.0, 1.2))
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job", ["c10d"], indirect=True)
def test_ctrl_c_ends_watch_while_the_store_host_does_not_answer(
    job: Job, procs: Processes, tmp_path: Path
) -> None:
    """The agents stopped (SIGSTOP) once the watchers drew: their next store calls hang
    until read_timeout (10 s); Ctrl-C must not wait for that."""
    agents = [job("--rdzv-conf", job.fast), job("--rdzv-conf", job.fast)]
    wait_for_members(job, 2)

    def stop_agents() -> None:
        for agent in agents:
            os.killpg(agent.pid, signal.SIGSTOP)

    try:
        problems = watchers_interrupted(job, procs, tmp_path, 4, (0.5, 3.0), stop_agents)
    finally:
        for agent in agents:
            os.killpg(agent.pid, signal.SIGCONT)
    assert not problems, "\n".join(problems)
