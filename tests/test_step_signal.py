"""A worker that listens for checkpoint requests defers the agent's preemption signal
(``elastic.training.preemption``): SLURM signals a whole step at once, workers included,
and a worker must not die of that signal while its agent asks it to save. Real worker
processes against a real control file; the agent's end is ``ControlFile``.

- The signal becomes a request (``checkpoint_requested()`` True) and the worker lives on,
  saves, and dies of the signal the agent sends once it says it is stopping them.
- A second signal, one the agent sends while stopping, and a deferral past the grace
  each end the worker as the default action would (exit -SIGTERM).
- No ``ELASTIC_PREEMPTION_SIGNAL`` (the agent does not coordinate a save on it), or a
  script with its own handler: nothing changes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic.core.workers.control_file import (
    ENV_PREEMPTION_GRACE,
    ENV_PREEMPTION_SIGNAL,
    SAVED_PENDING,
    ControlFile,
)
from elastic.testing.waits import wait_until

WORKER = """\
import signal, sys, time
import elastic
mode = sys.argv[1]
if mode == "own":
    signal.signal(signal.SIGTERM, lambda signum, frame: print("own handler", flush=True))
elastic.checkpoint_requested()  # the first call: the worker listens from now on
print("ready", flush=True)
while True:
    if elastic.checkpoint_requested():
        print("requested", flush=True)
        if mode == "save":
            elastic.checkpoint_saved()  # waits for the agent to stop this worker
    time.sleep(0.02)
"""


@pytest.fixture
def control(tmp_path: Path) -> Iterator[ControlFile]:
    file = ControlFile(1, directory=str(tmp_path))
    yield file
    file.close()


def start(
    control: ControlFile, tmp_path: Path, mode: str, grace: str | None = "30"
) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(control.worker_env(0))
    if grace is not None:
        env.update({ENV_PREEMPTION_SIGNAL: "SIGTERM", ENV_PREEMPTION_GRACE: grace})
    proc = subprocess.Popen(
        [sys.executable, str(script), mode], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def next_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline()


def ended_by_sigterm(proc: subprocess.Popen[str]) -> bool:
    return proc.wait(timeout=20) == -signal.SIGTERM


@pytest.mark.timeout(60)
def test_the_signal_is_a_request_and_the_agents_stop_ends_the_worker(
    control: ControlFile, tmp_path: Path
) -> None:
    proc = start(control, tmp_path, "save")
    proc.send_signal(signal.SIGTERM)
    assert next_line(proc) == "requested\n"
    assert proc.poll() is None  # alive, saving
    # Saved before its agent raised the request: "saved for the pending one".
    assert wait_until(lambda: control.all_saved(SAVED_PENDING), 10)
    control.stopping()
    proc.send_signal(signal.SIGTERM)
    assert ended_by_sigterm(proc)


@pytest.mark.timeout(60)
def test_a_second_signal_ends_the_worker(control: ControlFile, tmp_path: Path) -> None:
    proc = start(control, tmp_path, "save")
    proc.send_signal(signal.SIGTERM)
    assert next_line(proc) == "requested\n"
    proc.send_signal(signal.SIGTERM)
    assert ended_by_sigterm(proc)


@pytest.mark.timeout(60)
def test_the_agent_stopping_is_never_deferred(control: ControlFile, tmp_path: Path) -> None:
    proc = start(control, tmp_path, "save")
    control.stopping()
    proc.send_signal(signal.SIGTERM)
    assert ended_by_sigterm(proc)


@pytest.mark.timeout(60)
def test_no_save_within_the_grace_ends_the_worker(control: ControlFile, tmp_path: Path) -> None:
    proc = start(control, tmp_path, "never-save", grace="0.5")
    proc.send_signal(signal.SIGTERM)
    assert next_line(proc) == "requested\n"
    assert ended_by_sigterm(proc)


@pytest.mark.timeout(60)
def test_without_a_coordinated_notice_the_signal_keeps_its_default(
    control: ControlFile, tmp_path: Path
) -> None:
    proc = start(control, tmp_path, "save", grace=None)
    proc.send_signal(signal.SIGTERM)
    assert ended_by_sigterm(proc)


@pytest.mark.timeout(60)
def test_a_scripts_own_handler_stays(control: ControlFile, tmp_path: Path) -> None:
    proc = start(control, tmp_path, "own")
    proc.send_signal(signal.SIGTERM)
    assert next_line(proc) == "own handler\n"
    assert proc.poll() is None
    proc.kill()
    proc.wait()
