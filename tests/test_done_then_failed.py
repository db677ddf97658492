"""A worker that fails after every rank agreed training was done (``elastic.train``
returned) ends the job with that failure: it is not run again from its start, whatever
restart budget is left (issue: a worker aborting at exit reran a whole job)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """\
import os, sys
import elastic

out = sys.argv[1]
with open(os.path.join(out, "starts"), "a") as f:
    f.write("start\\n")


class Counter(elastic.State):
    def __init__(self):
        self.step = 0

    def capture_snapshot(self):
        return {"step": self.step}

    def apply_snapshot(self, snapshot):
        self.step = snapshot["step"]


def train_step(state):
    state.step += 1
    return state.step >= 3


elastic.train(train_step, Counter(), checkpointer="")
sys.exit(int(sys.argv[2]))  # the script's own end, after training was done
"""


def run(tmp_path: Path, code: int) -> tuple[subprocess.CompletedProcess[str], int]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [
            sys.executable, "-m", "elastic", "run", "--standalone", "--nproc-per-node=1",
            "--max-restarts=2", "--monitor-interval=0.1", str(script), str(tmp_path), str(code),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc, len((tmp_path / "starts").read_text().splitlines())


@pytest.mark.timeout(180)
def test_a_failure_after_training_was_done_is_not_run_again(tmp_path: Path) -> None:
    proc, starts = run(tmp_path, 3)
    assert starts == 1, proc.stderr  # not started again with two restarts left
    assert proc.returncode == 3, proc.stderr  # the job's outcome: its root cause's code
    assert "after every rank agreed training was done; not running it again" in proc.stderr


@pytest.mark.timeout(180)
def test_a_failure_before_training_was_done_is_still_restarted(tmp_path: Path) -> None:
    script = tmp_path / "early.py"
    script.write_text(
        "import os, sys\n"
        "with open(os.path.join(sys.argv[1], 'starts'), 'a') as f:\n"
        "    f.write('start\\n')\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.run(
        [
            sys.executable, "-m", "elastic", "run", "--standalone", "--nproc-per-node=1",
            "--max-restarts=1", "--monitor-interval=0.1", str(script), str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert len((tmp_path / "starts").read_text().splitlines()) == 2, proc.stderr
    assert proc.returncode == 3
