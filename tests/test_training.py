"""The State / train API: defaults, rollback of a raising step, checkpoints and resume,
and ranks rolling back together under a real gloo process group."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import elastic
import pytest
from elastic.core import checkpoint as ckpt
from elastic.plugins.checkpoint_fs.directory import FsCheckpointer
from elastic.testing.ports import free_port
from elastic.training.state import State


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ELASTIC_CHECKPOINT", "RANK", "WORLD_SIZE", "ELASTIC_METRICS_SINK"):
        monkeypatch.delenv(var, raising=False)


def test_lazy_exports() -> None:
    from elastic.core.metrics import put_metric
    from elastic.training.dist import init_process_group
    from elastic.training.loop import train

    assert elastic.State is State
    assert elastic.train is train
    assert elastic.init_process_group is init_process_group
    assert elastic.put_metric is put_metric


def test_state_defaults() -> None:
    state = State()
    state.sync(world_size=2, rank=1)
    assert state.capture_snapshot() is None
    state.apply_snapshot({"anything": 1})
    buf = io.BytesIO()
    state.save(buf)
    buf.seek(0)
    state.load(buf)  # the default pair round-trips (a None snapshot)


class Counter(State):
    """Sums the numbers 1..n into ``total``; ``history`` records what each step did."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.step = 0
        self.total = 0
        self.syncs: list[tuple[int, int]] = []

    def sync(self, world_size: int, rank: int) -> None:
        self.syncs.append((world_size, rank))

    def capture_snapshot(self) -> Any:
        return {"step": self.step, "total": self.total}

    def apply_snapshot(self, snapshot: Any) -> None:
        self.step, self.total = snapshot["step"], snapshot["total"]


def add_next(state: Counter) -> bool:
    state.step += 1
    state.total += state.step
    return state.step >= state.n


def test_state_save_load_through_snapshot() -> None:
    state = Counter(5)
    state.step, state.total = 3, 6
    buf = io.BytesIO()
    state.save(buf)
    other = Counter(5)
    buf.seek(0)
    other.load(buf)
    assert (other.step, other.total) == (3, 6)


def test_train_runs_until_step_returns_true() -> None:
    state = Counter(10)
    assert elastic.train(add_next, state, world_size=1, rank=0) == 10
    assert state.total == 55
    assert state.syncs == [(1, 0)]  # once at start


def test_rollback_on_raising_step() -> None:
    state = Counter(10)
    failures = {4: 2, 7: 1}  # step number -> times it fails (after mutating the state)

    def flaky(s: Counter) -> bool:
        s.step += 1
        s.total += s.step * 1000  # garbage that must be rolled back
        if failures.get(s.step, 0) > 0:
            failures[s.step] -= 1
            raise RuntimeError(f"bad batch at {s.step}")
        s.total -= s.step * 999
        return s.step >= s.n

    assert elastic.train(flaky, state, max_step_retries=2, world_size=4, rank=2) == 10
    assert state.total == 55  # as if nothing had failed
    assert state.syncs == [(4, 2)] * 4  # start + one sync per rollback


def test_too_many_retries_propagate() -> None:
    calls = []

    def always(s: Counter) -> bool:
        calls.append(1)
        raise ValueError("broken for good")

    with pytest.raises(ValueError, match="broken for good"):
        elastic.train(always, Counter(3), max_step_retries=2)
    assert len(calls) == 3  # first try + 2 retries


def test_no_snapshot_means_no_rollback() -> None:
    def boom(s: State) -> bool:
        raise KeyError("x")

    with pytest.raises(KeyError):
        elastic.train(boom, State())


def test_checkpoints_and_resume(tmp_path: Path) -> None:
    saver = FsCheckpointer(tmp_path, keep=2, rank=0)
    state = Counter(7)
    assert elastic.train(add_next, state, checkpointer=saver, checkpoint_every=3) == 7
    assert saver.steps() == [7, 6]  # every 3 steps, plus the final one; keep=2

    # A restarted worker resumes from the newest checkpoint instead of step 0.
    calls = []

    def counted(s: Counter) -> bool:
        calls.append(s.step)
        return add_next(s)

    resumed = Counter(9)
    assert elastic.train(counted, resumed, checkpointer=f"fs:{tmp_path}") == 9
    assert calls == [7, 8]
    assert resumed.total == 45


def test_checkpointer_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_CHECKPOINT", f"fs:{tmp_path}")
    elastic.train(add_next, Counter(4), checkpoint_every=2)
    assert FsCheckpointer(tmp_path).steps() == [4, 2]
    # "" opts out even when the variable is set.
    assert elastic.train(add_next, Counter(4), checkpointer="") == 4


def test_checkpointer_given_as_object_protocol() -> None:
    class Memory:
        def __init__(self) -> None:
            self.saved: dict[int, bytes] = {}

        def save(self, step: int, write: ckpt.Writer) -> None:
            buf = io.BytesIO()
            write(buf)
            self.saved[step] = buf.getvalue()

        def load_latest(self, read: ckpt.Reader) -> int | None:
            return None

    memory = Memory()
    assert isinstance(memory, ckpt.Checkpointer)
    elastic.train(add_next, Counter(2), checkpointer=memory, checkpoint_every=1)
    assert sorted(memory.saved) == [1, 2]


TWO_RANKS = """
import os, sys
import torch
import torch.distributed as dist
import elastic

class S(elastic.State):
    def __init__(self):
        self.step, self.total, self.syncs = 0, 0, 0
    def sync(self, world_size, rank):
        self.syncs += 1
    def capture_snapshot(self):
        return (self.step, self.total)
    def apply_snapshot(self, snap):
        self.step, self.total = snap

failed = []
def step(s):
    s.step += 1
    t = torch.tensor([s.step])
    dist.all_reduce(t)  # the step's own collective, before it may raise
    s.total += int(t)
    if dist.get_rank() == 1 and s.step == 3 and not failed:
        failed.append(1)
        raise RuntimeError("rank 1 only")
    return s.step >= 5

elastic.init_process_group(timeout=30)
s = S()
n = elastic.train(step, s)
print(f"RESULT {dist.get_rank()} {n} {s.total} {s.syncs}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ranks_roll_back_together_with_gloo(tmp_path: Path) -> None:
    """Only rank 1 raises, yet both ranks roll back step 3 and both finish in step."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
        )
        env.pop("ELASTIC_CHECKPOINT", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", TWO_RANKS], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = sorted(line for out in outs for line in out.splitlines() if line.startswith("RESULT"))
    # total = 2 * (1+2+3+4+5); two syncs each: start + the rollback.
    assert results == ["RESULT 0 5 30 2", "RESULT 1 5 30 2"]
