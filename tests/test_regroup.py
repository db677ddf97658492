"""The in-place regroup hand-off through the control file, in one process: the agent's
end (``ControlFile``) against the worker's (``elastic.training.regroup``), and the
worker API outside ``elastic run``; where workers that did not take a round are, from
their stacks. The multi-host runs are in ``tests/test_regroup_multihost.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic.core.agent.regroup import BOUNDARY_WAIT, Untaken, patience, untaken
from elastic.core.workers.control_file import (
    BROKEN,
    ENV_CONTROL,
    ENV_CONTROL_SLOT,
    HEADER,
    SLOT,
    STEP_US,
    ControlFile,
    round_path,
    slot_offset,
)
from elastic.training import control, preemption, regroup, rounds


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlFile]:
    """A 2-worker node's control file; this process is local rank 1's worker."""
    file = ControlFile(2, directory=str(tmp_path))
    monkeypatch.setenv(ENV_CONTROL, file.path)
    monkeypatch.setenv(ENV_CONTROL_SLOT, "1")
    preemption._reset_for_tests()
    yield file
    preemption._reset_for_tests()
    file.close()


def test_the_layout_is_one_definition() -> None:
    assert HEADER.size == 5 * 8 and SLOT.size == 8 * 8
    assert slot_offset(1) == HEADER.size + SLOT.size
    assert STEP_US < SLOT.size // 8


def test_outside_elastic_run_nothing_changes_and_regroup_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_CONTROL, raising=False)
    preemption._reset_for_tests()
    assert regroup.membership_changed() is False
    assert regroup.opt_in() is False
    with pytest.raises(RuntimeError, match="needs a worker started by `elastic run`"):
        regroup.regroup()
    preemption._reset_for_tests()


def test_capable_only_when_every_worker_said_so(node: ControlFile) -> None:
    assert not node.all_capable()
    assert regroup.membership_changed() is False  # the first call opts in
    assert not node.all_capable()  # local rank 0 has not
    control.reset_for_tests()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_CONTROL_SLOT, "0")
        regroup.opt_in()
    control.reset_for_tests()
    assert node.all_capable()


def test_a_request_and_a_round_reach_the_worker(node: ControlFile) -> None:
    assert not regroup.membership_changed()
    node.request_regroup()
    assert regroup.membership_changed()
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "29555"}
    generation = node.hand_over({0: {"RANK": "2"}, 1: env})
    assert generation == 1 and json.loads(Path(round_path(node.path)).read_text())
    assert rounds.wait_for_round(0) == (1, env)
    assert node.joined(1) == set()  # taken only once the worker says so (regroup does)


def test_a_garbled_round_file_is_not_taken(node: ControlFile) -> None:
    node.hand_over({1: {"RANK": "1"}})
    path = Path(round_path(node.path))
    for bad in ("{", '{"generation": 1, "ranks": {"1": {"RANK": 1}}}', '{"ranks": {}}', "[]"):
        path.write_text(bad)
        assert rounds.read_round(0) is None, bad
    path.write_text(json.dumps({"generation": 1, "ranks": {"1": {"RANK": "1"}}}))
    assert rounds.read_round(1) is None  # not newer than what the worker runs in
    assert rounds.read_round(0) == (1, {"RANK": "1"})


def test_a_worker_still_starting_takes_the_round_the_job_re_formed_into(
    node: ControlFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job re-forms while the worker starts: its agent asks for a regroup, then hands
    the new round over; the worker, about to create its group, waits for it and takes it
    (``elastic.init_process_group``), instead of joining the round it was started in."""
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "3"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)  # restored after the test
    assert not rounds.take_pending()  # nothing asked: the round it started in holds
    node.request_regroup()
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29555"}
    handed = threading.Timer(0.3, node.hand_over, args=({0: {"RANK": "1"}, 1: env},))
    handed.start()
    assert rounds.take_pending()  # waits for the round while the agent forms it
    handed.join()
    assert (os.environ["RANK"], os.environ["MASTER_PORT"]) == ("0", "29555")
    assert node.joined(1) == {1}  # the agent sees it took the round
    assert not rounds.take_pending()  # taken: no round pending any more


def test_a_broken_worker_asks_and_its_step_time_bounds_the_wait(node: ControlFile) -> None:
    assert not node.broken()
    regroup._last_boundary.clear()
    regroup.membership_changed()  # the first boundary: no step measured yet
    assert node.longest_step() == 0
    time.sleep(0.25)
    regroup.membership_changed()  # a script's own boundary check measures its step too
    assert 0.25 <= node.longest_step() < 1.0
    control.set_mine(BROKEN, 1)
    assert node.broken()
    node.hand_over({0: {}, 1: {}})
    assert not node.broken()  # the round it waited for is out


def test_close_removes_the_round_file_too(tmp_path: Path) -> None:
    file = ControlFile(1, directory=str(tmp_path))
    file.hand_over({0: {"RANK": "0"}})
    file.close()
    assert list(tmp_path.iterdir()) == []


# A worker that opted in to regroup: local rank 0 sleeps in a step (user code), local rank 1
# waits for it in a gloo all_reduce; each says when it is there.
WORKER = """
import os, sys, time
from elastic.training import regroup
assert regroup.opt_in()
import torch
import torch.distributed as dist
rank = int(os.environ["ELASTIC_CONTROL_SLOT"])
dist.init_process_group("gloo", init_method=sys.argv[1], rank=rank, world_size=2)
open(sys.argv[2] + str(rank), "w").close()
if rank == 0:
    time.sleep(120)  # stuck in a step
dist.all_reduce(torch.ones(1))
"""


class Worker:
    def __init__(self, local_rank: int, proc: subprocess.Popen[bytes]) -> None:
        self.local_rank, self.proc, self.pid = local_rank, proc, proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()


def test_the_stacks_say_which_untaken_worker_is_stuck_and_which_waits(tmp_path: Path) -> None:
    """``untaken`` (the agent, its bound for taking a round run out) dumps the stacks the
    workers registered as they opted in: one asleep in its step is stuck, one in a
    collective waits; a worker that never registered leaves it undecided."""
    node = ControlFile(3, directory=str(tmp_path))
    script, there = tmp_path / "worker.py", str(tmp_path / "there-")
    script.write_text(WORKER)
    init = f"file://{tmp_path / 'rendezvous'}"
    workers = []
    try:
        for rank in range(2):
            env = {**os.environ, **node.worker_env(rank)}
            proc = subprocess.Popen([sys.executable, str(script), init, there], env=env)
            workers.append(Worker(rank, proc))
        plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        workers.append(Worker(2, plain))
        started = lambda: all(os.path.exists(there + str(r)) for r in range(2))  # noqa: E731
        deadline = time.monotonic() + 60
        while not started() and time.monotonic() < deadline:
            assert all(w.poll() is None for w in workers)
            time.sleep(0.05)
        assert started()
        time.sleep(0.5)  # rank 1 is in its all_reduce by now
        found = untaken(node, 1, workers)
        assert found.waiting is False
        assert len(found.stuck) == 1 and found.stuck[0].startswith("local rank 0 at "), found
        assert "time.sleep(120)" in found.stuck[0]
        assert untaken(node, 1, workers[1:2]) == Untaken(True, [])  # waits in a collective
        assert untaken(node, 1, workers[1:]) == Untaken(None, [])  # 2 gave no dump
        stack_files = [Path(node.stack_file(r)) for r in range(2)]
        assert all(f.stat().st_size > 0 for f in stack_files)
    finally:
        for w in workers:
            w.proc.kill()
            w.proc.wait()
        node.close()
    assert not any(f.exists() for f in stack_files)  # close removes them with the file


def test_the_stuck_node_gives_up_first_and_rank_0_breaks_ties() -> None:
    """The order nodes whose bounds ran out together give up in (``patience``)."""
    stuck, blind, blind_first = patience(False, True), patience(None, False), patience(None, True)
    waiting, waiting_first = patience(True, False), patience(True, True)
    assert stuck == blind == 0.0
    assert 0.0 < blind_first < waiting < waiting_first
    assert waiting >= BOUNDARY_WAIT  # the stuck node's bound may run out seconds later
