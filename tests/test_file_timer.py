"""torch's FileTimer protocol served by the agent (``TORCHELASTIC_ENABLE_FILE_TIMER=1``):
torch's own ``FileTimerClient`` in a worker, an overrun kills only that worker with the
signal it asked for, the failure names the timer's scope, the agent survives (torch 2.13's
server SIGKILLs its launcher) and restarts the job; the server never kills a process that
is not one of its workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic.harness.commands import cli_env, run_elastic, write_script
from elastic.harness.processes import pid_alive
from elastic.testing.waits import wait_until

WORKER = """
import os, signal, sys, time
from torch.distributed.elastic.timer import FileTimerClient, configure, expires

out = sys.argv[1]
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=signal.SIGUSR1))
with expires(after=5, scope="warm_up"):  # released in time: nothing happens
    time.sleep(0.2)
if rank == "1" and attempt == "0":
    with open(os.path.join(out, "pid1"), "w") as f:
        f.write(str(os.getpid()))
    with expires(after=1, scope="load_batch"):
        time.sleep(60)  # overruns its timer
    sys.exit(3)  # never reached: SIGUSR1 ends it
if attempt == "0":
    time.sleep(60)  # rank 0 is stopped by the agent, not by a timer
open(os.path.join(out, f"done-{attempt}-{rank}"), "w").close()
"""


def launch(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    script = write_script(tmp_path, "timer_worker.py", WORKER)
    return run_elastic(
        "run",
        "--standalone",
        "--nproc-per-node=2",
        f"--error-summary={tmp_path / 'summary.json'}",
        *flags,
        script,
        str(tmp_path),
        env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_overrun_kills_only_that_worker_with_its_signal(tmp_path: Path) -> None:
    proc = launch(tmp_path)
    assert proc.returncode == 128 + signal.SIGUSR1, proc.stderr  # the agent itself exited
    data = json.loads((tmp_path / "summary.json").read_text())
    root = data["root_cause"]
    assert root["rank"] == 1 and root["signal"] == "SIGUSR1"
    assert root["pid"] == int((tmp_path / "pid1").read_text())
    assert root["extra"]["file_timer"]["scope"] == "load_batch"
    assert "load_batch" in root["message"]
    assert "time.sleep(60)" in root["extra"]["stacks"]  # dumped before the signal
    assert data["others"] == []  # rank 0 was stopped by the agent: not a timer victim
    assert "FileTimer scope 'load_batch' of worker rank 1" in proc.stderr
    assert "warm_up" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_overrun_restarts_and_the_job_finishes(tmp_path: Path) -> None:
    proc = launch(tmp_path, "--max-restarts=1")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "done-1-0").exists() and (tmp_path / "done-1-1").exists()
    assert proc.stderr.count("FileTimer scope 'load_batch' of worker rank 1") == 1


@pytest.mark.timeout(60)
def test_server_protocol_with_torchs_client(tmp_path: Path) -> None:
    """Our server, torch's client in a real child: an expired timer signals the child;
    a malformed line or a request for a process that is not ours changes nothing."""
    from elastic.core.watchdog.file_timer import FileTimerServer

    child_code = (
        "import signal, sys, time\n"
        "from torch.distributed.elastic.timer import FileTimerClient\n"
        "client = FileTimerClient(sys.argv[1], signal=signal.SIGTERM)\n"
        "client.acquire('kept', time.time() + 60)\n"
        "client.acquire('short', time.time() + 0.5)\n"
        "print('armed', flush=True)\n"
        "time.sleep(60)\n"
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = str(tmp_path / "timer_pipe")
    expired: list[tuple[int, str, list[str]]] = []
    owned: set[int] = set()
    server = FileTimerServer(
        path,
        owns=lambda pid: pid in owned,
        on_expired=lambda req, scopes: expired.append((req.pid, req.scope_id, scopes)),
    ).start()
    child = None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"this is not json\n")
        request = {
            "version": 1,
            "pid": bystander.pid,
            "scope_id": "foreign",
            "expiration_time": time.time() - 1,
            "signal": int(signal.SIGKILL),
        }
        os.write(fd, (json.dumps(request) + "\n").encode())
        os.close(fd)
        child = subprocess.Popen(
            [sys.executable, "-c", child_code, path],
            stdout=subprocess.PIPE,
            text=True,
            env=cli_env(),
        )
        owned.add(child.pid)
        assert child.stdout is not None and child.stdout.readline().strip() == "armed"
        assert child.wait(timeout=20) == -signal.SIGTERM
        assert expired == [(child.pid, "short", ["short"])]  # 'kept' had not expired
        assert pid_alive(bystander.pid)  # not one of ours: never signalled
        assert server.bad_requests == 1 and server.requests >= 3
        assert wait_until(lambda: child.pid not in server.armed(), timeout=5)
    finally:
        server.stop()
        bystander.kill()
        bystander.wait()
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
    assert not os.path.exists(path)


ARMED = """
import os, signal, time
from torch.distributed.elastic.timer import FileTimerClient, configure, expires

configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=signal.SIGKILL))
with expires(after=30, scope="slow_but_declared"):
    time.sleep({idle})  # idle for longer than --stall-timeout, inside its own deadline
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_armed_timer_governs_instead_of_the_stall_timeout(tmp_path: Path) -> None:
    stall_timeout = 3.0
    script = write_script(tmp_path, "armed.py", ARMED.format(idle=stall_timeout * 2))
    proc = run_elastic(
        "run",
        "--standalone",
        f"--stall-timeout={stall_timeout}",
        script,
        env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert "stall" not in proc.stderr
