"""Worker processes for real: process groups, death with the agent, stopping, reaping."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from elastic.core.workers.process import (
    CallableWorker,
    CommandWorker,
    signal_name,
    stop_workers,
)
from elastic.harness.processes import pid_alive
from elastic.testing.waits import wait_until


def _pids(path: Path, n: int, timeout: float = 15) -> list[int]:
    assert wait_until(lambda: path.exists() and len(path.read_text().split()) >= n, timeout)
    return [int(p) for p in path.read_text().split()[:n]]


def square(x: int) -> int:
    return x * x


def report_group(path: str) -> str:
    return f"{os.getpid()} {os.getpgid(0)} {os.getsid(0)} {os.environ.get('WORKER_VAR')}"


def raise_error() -> None:
    raise ValueError("boom in callable")


def test_command_worker_leads_its_own_session(tmp_path: Path) -> None:
    w = CommandWorker(0, [sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ))
    try:
        assert os.getpgid(w.pid) == w.pid
        assert os.getsid(w.pid) == w.pid
        assert w.poll() is None
    finally:
        codes = stop_workers([w], signal.SIGTERM, 5)
    assert codes == {0: -signal.SIGTERM}
    assert not pid_alive(w.pid)


def test_stop_escalates_to_sigkill_and_kills_the_whole_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        with open({str(pids)!r}, "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(60)
        """
    )
    w = CommandWorker(0, [sys.executable, "-c", script], dict(os.environ))
    leader, grandchild = _pids(pids, 2)
    t0 = time.monotonic()
    codes = stop_workers([w], signal.SIGTERM, timeout=0.5)
    elapsed = time.monotonic() - t0
    assert codes == {0: -signal.SIGKILL}
    assert 0.4 < elapsed < 5
    assert not pid_alive(leader)  # reaped: no zombie left behind
    assert not os.path.exists(f"/proc/{leader}")
    assert wait_until(lambda: not pid_alive(grandchild), 5)


def test_worker_dies_when_its_agent_is_sigkilled(tmp_path: Path, procs) -> None:  # noqa: ANN001
    """PR_SET_PDEATHSIG: no orphan survives a SIGKILLed agent."""
    pids = tmp_path / "pids"
    agent = textwrap.dedent(
        f"""
        import os, sys, time
        from elastic.core.workers.process import CommandWorker
        ws = [CommandWorker(i, [sys.executable, "-c", "import time; time.sleep(60)"],
                            dict(os.environ)) for i in range(2)]
        with open({str(pids)!r}, "w") as f:
            f.write(" ".join(str(w.pid) for w in ws))
        time.sleep(60)
        """
    )
    proc = procs.start([sys.executable, "-c", agent])
    workers = _pids(pids, 2)
    assert all(pid_alive(p) for p in workers)
    os.kill(proc.pid, signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(p) for p in workers), 5)


def test_output_goes_to_the_given_files(tmp_path: Path) -> None:
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    cmd = [sys.executable, "-c", "import sys; print('to out'); print('to err', file=sys.stderr)"]
    w = CommandWorker(0, cmd, dict(os.environ), str(out), str(err))
    assert w.reap(15) == 0
    assert out.read_text() == "to out\n"
    assert err.read_text() == "to err\n"


def test_devnull_destination(tmp_path: Path) -> None:
    w = CommandWorker(0, [sys.executable, "-c", "print('x')"], dict(os.environ), os.devnull)
    assert w.reap(15) == 0


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_callable_worker_returns_its_value(method: str) -> None:
    w = CallableWorker(0, square, (7,), {"WORKER_VAR": "x"}, start_method=method)
    assert w.reap(30) == 0
    assert w.return_value() == 49


def test_callable_worker_has_own_group_and_env(tmp_path: Path) -> None:
    w = CallableWorker(0, report_group, ("",), {"WORKER_VAR": "hello"}, start_method="fork")
    assert w.reap(30) == 0
    pid, pgid, sid, var = w.return_value().split()
    assert int(pid) == w.pid == int(pgid) == int(sid)
    assert var == "hello"


def test_callable_worker_exception_writes_error_file(tmp_path: Path) -> None:
    err = tmp_path / "stderr.log"
    error_file = tmp_path / "error.json"
    env = {"TORCHELASTIC_ERROR_FILE": str(error_file)}
    w = CallableWorker(0, raise_error, (), env, start_method="fork", stderr=str(err))
    assert w.reap(30) == 1
    assert w.return_value() is None
    assert "boom in callable" in err.read_text()
    from elastic.core.workers.errorfile import read_error_file

    content = read_error_file(str(error_file))
    assert content is not None and content.message == "ValueError: boom in callable"


def test_signal_name() -> None:
    assert signal_name(-9) == "SIGKILL"
    assert signal_name(-15) == "SIGTERM"
    assert signal_name(1) is None
    assert signal_name(0) is None
    assert signal_name(None) is None


def test_exited_worker_keeps_its_pid_until_reaped() -> None:
    """poll() does not reap, so a later killpg cannot hit a group that reused the pid."""
    w = CommandWorker(0, [sys.executable, "-c", "raise SystemExit(4)"], dict(os.environ))
    assert wait_until(lambda: w.poll() is not None, 15)
    assert w.poll() == 4
    assert os.path.exists(f"/proc/{w.pid}")  # a zombie, still ours
    assert stop_workers([w], signal.SIGTERM, 1) == {0: 4}
    assert not os.path.exists(f"/proc/{w.pid}")


def test_killed_worker_reports_the_signal() -> None:
    w = CommandWorker(0, [sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ))
    os.kill(w.pid, signal.SIGKILL)
    assert wait_until(lambda: w.poll() is not None, 15)
    assert w.poll() == -signal.SIGKILL
    stop_workers([w], signal.SIGTERM, 1)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_callable_workers_die_when_their_agent_is_sigkilled(
    tmp_path: Path,
    procs,  # noqa: ANN001
    method: str,
) -> None:
    agent = textwrap.dedent(
        f"""
        import sys, time
        from elastic.core.workers.process import CallableWorker
        ws = [CallableWorker(i, time.sleep, (60,), {{}}, start_method={method!r})
              for i in range(2)]
        print(" ".join(str(w.pid) for w in ws), flush=True)
        time.sleep(60)
        """
    )
    proc = procs.start([sys.executable, "-c", agent])
    assert proc.stdout is not None
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert len(workers) == 2 and all(pid_alive(p) for p in workers)
    # own sessions once the bootstrap has run (then the death signal is armed too)
    assert wait_until(lambda: all(os.getsid(p) == p for p in workers), 20)
    os.kill(proc.pid, signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(p) for p in workers), 5)
