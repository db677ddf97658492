"""After a start or a regroup, the step number and the state come from one rank, the most
tenured, and every rank provably holds its state (``elastic.training.tenure``).

The digest is checked in one process; the agreement is checked with real agents
(``elastic run``, etcd-v3 on loopback) and gloo workers, one per node, where a peer dies
halfway through a step's agreement: its all_reduce completed on one survivor, which
counts the step, while the other survivor rolls it back. The survivors regroup in place
at different steps, and must go on from the one that counted it, with its state."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from elastic.harness.accumulator import ACCUMULATOR_STATE
from elastic.harness.processes import Processes
from elastic.testing.etcd import EtcdCluster
from elastic.training import tenure
from elastic.training.state import State

pytest_plugins = ["elastic.testing.etcd"]


def test_the_digest_follows_content_not_identity_or_order() -> None:
    one = {"step": 3, "w": torch.arange(6.0).reshape(2, 3), "tags": {"a", "b"}}
    two = {"tags": {"b", "a"}, "w": torch.arange(6.0).reshape(2, 3).clone(), "step": 3}
    assert tenure.snapshot_digest(one) == tenure.snapshot_digest(two)
    changed = dict(one, w=one["w"] + torch.tensor(1e-7))
    assert tenure.snapshot_digest(changed) != tenure.snapshot_digest(one)
    reshaped = dict(one, w=one["w"].reshape(3, 2))  # same bytes, another shape
    assert tenure.snapshot_digest(reshaped) != tenure.snapshot_digest(one)
    strided = torch.arange(12.0).reshape(3, 4)[:, ::2]  # a view: its elements, not storage
    assert tenure.snapshot_digest(strided) == tenure.snapshot_digest(strided.contiguous())
    assert tenure.snapshot_digest([1, "1"]) != tenure.snapshot_digest(["1", 1])
    assert tenure.snapshot_digest((True,)) != tenure.snapshot_digest((1,))


def test_a_snapshot_that_cannot_be_digested_skips_the_check_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Unpicklable(State):
        def capture_snapshot(self) -> Any:
            return {"f": lambda: 0}

    assert Unpicklable().sync_digest() is None
    assert "override State.sync_digest" in capsys.readouterr().err
    assert State().sync_digest() is None  # no snapshot: nothing to check


def test_the_most_tenured_is_the_highest_step_then_the_lowest_rank() -> None:
    assert tenure.most_tenured([4, 5, 5, 1]) == 1
    assert tenure.most_tenured([0, 0]) == 0
    with pytest.raises(RuntimeError, match="only inside a State.sync"):
        tenure.tenured_rank()
    with tenure.syncing_from(2):
        assert tenure.tenured_rank() == 2
    with pytest.raises(RuntimeError):
        tenure.tenured_rank()


def test_mismatched_ranks_compares_everyone_after_with_the_source_before() -> None:
    same, other = b"a" * 16, b"b" * 16
    rows = [
        tenure.digest_words(None) + tenure.digest_words(same),
        tenure.digest_words(same) + tenure.digest_words(same),
        tenure.digest_words(None) + tenure.digest_words(other),
        tenure.digest_words(None) + tenure.digest_words(None),  # not judged
    ]
    assert tenure.mismatched_ranks(rows, 1) == [2]
    assert tenure.mismatched_ranks(rows, 0) is None  # the source gave no digest


WORKER = (
    """
import json, os, signal, sys, time
import torch, torch.distributed as dist
import elastic
from elastic.training import loop

STEPS, SPLIT_AT = 30, 6
good = sys.argv[1] != "least"
dies_in_sync = sys.argv[1] == "sync"  # the dying rank dies halfway through the first sync
out = os.environ["OUT"]
first_rank = int(os.environ["RANK"])  # roles by the first round's rank
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
role = {0: "behind", 1: "ahead", 2: "dies"}[first_rank]


def note(event, **kw):
    line = dict(event=event, role=role, pid=os.getpid(), world=int(os.environ["WORLD_SIZE"]),
                rank=int(os.environ["RANK"]), restart=restart, **kw)
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\\n")


"""
    + ACCUMULATOR_STATE
    + """
class Accumulator(AccumulatorState):
    def sync(self, world_size, rank):
        every = self.gather_snapshots(world_size)
        if good:
            source = elastic.tenured_rank()
        else:  # a wrong sync: the least advanced rank's state
            source = min(range(world_size), key=lambda r: (every[r]["step"], r))
        if dies_in_sync and role == "dies" and restart == 0:
            note("dies", step=self.step)  # the others got its snapshot, not the digests
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        note("sync", before=self.step, step=every[source]["step"], value=every[source]["value"])
        self.apply_snapshot(every[source])


state = Accumulator()
real = loop._all_reduce_max


def agreement(values):
    # The agreement after step SPLIT_AT, the first time only: every rank's contribution
    # goes in; the dying rank then dies and the one "behind" never hears the result.
    split = len(values) == 4 and state.step == SPLIT_AT and restart == 0 and not dies_in_sync
    if split and role == "dies":
        real(values)
        note("dies", step=state.step)
        os.kill(os.getppid(), signal.SIGKILL)  # the whole node at once
        os.kill(os.getpid(), signal.SIGKILL)
    if split and role == "behind" and dist.get_world_size() == 3:
        real(values)
        note("cut_short", step=state.step)
        raise RuntimeError("Connection closed by peer (the agreement's result never came)")
    return real(values)


loop._all_reduce_max = agreement


def train_step(s):
    t = torch.tensor([s.step + 1 + dist.get_rank() * 0], dtype=torch.int64)
    dist.all_reduce(t)
    s.value = (s.value * 31 + int(t.item()) // dist.get_world_size()) % (2**61 - 1)
    s.step += 1
    note("step", step=s.step, value=s.value)
    if not os.path.exists(os.path.join(out, "hurry")):  # the test saw the 2-rank world train
        time.sleep(0.1)
    return s.step >= STEPS


elastic.init_process_group(backend="gloo", timeout=60)
last = elastic.train(train_step, state, checkpointer="")
note("done", last=last, step=state.step, value=state.value)
dist.barrier()
dist.destroy_process_group()
"""
)

CONF = "heartbeat_interval=0.5,heartbeat_timeout=2.5,close_timeout=10,last_call_timeout=2"


def reference() -> int:
    value = 0
    for step in range(1, 31):
        value = (value * 31 + step) % (2**61 - 1)
    return value


def hurry_once_in_two(workdir: Path, done: threading.Event) -> None:
    """Writes ``hurry`` once both survivors (roles "ahead" and "behind") completed a step
    in the 2-rank world; gives up when ``done`` is set."""
    while not done.wait(0.2):
        roles = set()
        for line in (workdir / "events.jsonl").read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a line being written
                continue
            if event["event"] == "step" and event["world"] == 2:
                roles.add(event["role"])
        if roles >= {"ahead", "behind"}:
            (workdir / "hurry").touch()
            return


def run_split_job(
    procs: Processes, etcd: EtcdCluster, tmp_path: Path, mode: str
) -> tuple[list[dict[str, Any]], list[str], list[int | None]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "events.jsonl").touch()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OUT=str(tmp_path))
    agents = []
    for _ in range(3):
        agents.append(
            procs.elastic(
                "run",
                "--nnodes=2:3",
                "--nproc-per-node=1",
                "--rdzv-backend=etcd-v3",
                f"--rdzv-endpoint={etcd.endpoint}",
                f"--rdzv-id=split-{mode}",
                f"--rdzv-conf={CONF}",
                "--monitor-interval=0.1",
                "--max-restarts=0",
                str(script),
                mode,
                env=env,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
    # Once both survivors stepped in the 2-rank world, the rest of the steps, there so the
    # job outlasts the regroup, run without their pause (read beside the agents' output).
    done = threading.Event()
    hurry = threading.Thread(target=hurry_once_in_two, args=(tmp_path, done), daemon=True)
    hurry.start()
    codes: list[int | None] = []
    outs = []
    try:
        for agent in agents:
            try:
                out, _ = agent.communicate(timeout=150)
            except subprocess.TimeoutExpired:
                agent.kill()
                out, _ = agent.communicate()
            codes.append(agent.returncode)
            outs.append(out)
    finally:
        done.set()
        hurry.join()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], outs, codes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_after_a_peer_dies_mid_agreement_survivors_go_on_from_the_most_tenured(
    procs: Processes, etcd_v3_server: EtcdCluster, tmp_path: Path
) -> None:
    events, outs, codes = run_split_job(procs, etcd_v3_server, tmp_path, "tenured")
    text = "\n".join(outs)
    roles = {e["role"]: e for e in events if e["event"] in ("dies", "cut_short")}
    assert set(roles) == {"dies", "behind"}, text
    split_at = roles["behind"]["step"]
    # The one ahead counted the step, the one behind rolled it back.
    ahead = [e for e in events if e["role"] == "ahead" and e["event"] == "step" and e["world"] == 3]
    assert max(e["step"] for e in ahead) >= split_at, text
    syncs = [e for e in events if e["event"] == "sync" and e["world"] == 2]
    assert {e["role"] for e in syncs} == {"ahead", "behind"}, (events, text)
    befores = {e["role"]: e["before"] for e in syncs}
    assert befores["behind"] == split_at - 1 and befores["ahead"] == split_at, befores
    # Both took the state of the one ahead: same step and value, that step.
    assert {(e["step"], e["value"]) for e in syncs} == {
        next((e["step"], e["value"]) for e in ahead if e["step"] == split_at)
    }
    done = [e for e in events if e["event"] == "done"]
    assert sorted(e["role"] for e in done) == ["ahead", "behind"], text
    # The loop's step counter is the state's own, and the result is exact.
    assert {(e["last"], e["step"], e["value"]) for e in done} == {(30, 30, reference())}, done
    # One step redone at most: the one behind redid it from the regroup on.
    steps = [
        e["step"]
        for e in events
        if e["event"] == "step" and e["role"] == "behind" and e["world"] == 2
    ]
    assert min(steps) == split_at + 1, steps
    assert sorted(codes, key=str) == [-9, 0, 0], (codes, text)  # the dead node, two successes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sync_that_hands_out_another_ranks_state_is_one_clear_error(
    procs: Processes, etcd_v3_server: EtcdCluster, tmp_path: Path
) -> None:
    events, outs, codes = run_split_job(procs, etcd_v3_server, tmp_path, "least")
    text = "\n".join(outs)
    syncs = [e for e in events if e["event"] == "sync" and e["world"] == 2]
    assert len(syncs) == 2, (events, text)
    ahead_rank = next(e["rank"] for e in syncs if e["role"] == "ahead")
    pattern = re.compile(
        r"elastic\.train: after State\.sync, rank\(s\) 0, 1 of 2 do not hold the state of rank "
        rf"{ahead_rank}, the most tenured \(step (\d+)\)"
    )
    found = pattern.findall(text)
    assert len(found) == 2 and len(set(found)) == 1, text  # the same line on both ranks
    assert not [e for e in events if e["event"] == "done"], events
    assert 0 not in codes, (codes, text)  # the job failed on every node
    # nothing trained on past the check
    assert not [e for e in events if e["event"] == "step" and e["world"] == 2], events


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_dying_halfway_through_the_sync_is_undone_and_synced_again(
    procs: Processes, etcd_v3_server: EtcdCluster, tmp_path: Path
) -> None:
    """The first sync of a 3-node job: every rank has handed out its snapshot when one
    node dies (before the digests are compared). The other two put back what they held,
    re-form as two and sync again: they train on from there and end with the exact
    result; before, the broken sync was an error and both exited 1."""
    events, outs, codes = run_split_job(procs, etcd_v3_server, tmp_path, "sync")
    text = "\n".join(outs)
    assert [e["role"] for e in events if e["event"] == "dies"] == ["dies"], text
    assert "the state sync broke" in text, text
    syncs = [e for e in events if e["event"] == "sync" and e["world"] == 2]
    assert {e["role"] for e in syncs} == {"ahead", "behind"}, (events, text)
    done = [e for e in events if e["event"] == "done"]
    assert {(e["last"], e["step"], e["value"]) for e in done} == {(30, 30, reference())}, text
    assert sorted(codes, key=str) == [-9, 0, 0], (codes, text)
