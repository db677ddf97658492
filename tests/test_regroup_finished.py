"""The agent's in-place regroup when the workers' last step boundary was their last: ranks
that agreed training is done (``DONE`` in their control-file slot) are never taken for
workers stuck before the new round, even while they still tear the old group down."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic.core.agent.regroup import BOUNDARY_WAIT, finished_untaken, wait_taken
from elastic.core.workers.control_file import (
    DONE,
    ENV_CONTROL,
    ENV_CONTROL_SLOT,
    ControlFile,
)
from elastic.training import control, preemption


class Worker:
    """A real process in the agent's ``WorkerProcess`` shape."""

    def __init__(self, local_rank: int, seconds: float) -> None:
        self.local_rank = local_rank
        code = f"import time; time.sleep({seconds})"
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def reap(self, timeout: float) -> int | None:
        return self.proc.wait(timeout)

    def return_value(self) -> Any:
        return None


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlFile]:
    """A 1-worker node's control file; this process writes local rank 0's slot."""
    file = ControlFile(1, directory=str(tmp_path))
    monkeypatch.setenv(ENV_CONTROL, file.path)
    monkeypatch.setenv(ENV_CONTROL_SLOT, "0")
    preemption._reset_for_tests()
    yield file
    preemption._reset_for_tests()
    file.close()


def test_a_done_worker_still_exiting_finished_in_the_old_round(node: ControlFile) -> None:
    # its ranks agreed the job is done; its exit (the old group's barrier) takes a while
    worker = Worker(0, seconds=1.5)
    try:
        control.set_mine(DONE, 1)
        generation = node.hand_over({0: {"RANK": "0"}})
        began = time.monotonic()
        assert wait_taken(node, generation, [worker], time.sleep)
        assert time.monotonic() - began < 1.0  # not the bound: it will never take the round
        assert finished_untaken(node, generation, [worker], time.sleep)
        assert worker.poll() == 0  # waited for, not left to be stopped
        assert time.monotonic() - began < BOUNDARY_WAIT
    finally:
        worker.proc.kill()
        worker.proc.wait()


def test_a_running_worker_that_is_not_done_has_not_finished(node: ControlFile) -> None:
    worker = Worker(0, seconds=30)
    try:
        generation = node.hand_over({0: {"RANK": "0"}})
        began = time.monotonic()
        assert not finished_untaken(node, generation, [worker], time.sleep)
        assert time.monotonic() - began < 1.0 and worker.poll() is None
    finally:
        worker.proc.kill()
        worker.proc.wait()
