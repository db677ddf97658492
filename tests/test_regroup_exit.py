"""A worker that regrouped in place exits cleanly: its default process group is torn
down before the interpreter finalizes (``elastic.training.dist``), never during
finalization, where a gloo thread taking the GIL aborts the worker (SIGABRT, "terminate
called without an active exception") after a successful run, and the agent would run
the whole job again. Nothing else may hold the group past its destroy: not torch's
functions that bound it as a default (a group made before the first optimizer), nor the
exception a done worker ended with when a peer went away during its last barrier."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from elastic.harness.accumulator import ACCUMULATOR_STATE
from elastic.harness.processes import Processes
from elastic.testing.etcd import EtcdCluster
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until

pytest_plugins = ["elastic.testing.etcd"]

# Regroups in place by hand (leave, a new store port, rejoin), as a round change does,
# and ends without destroy_process_group. A handler registered before the group was
# made runs after elastic's (atexit is last in, first out): the group is gone by then.
ONE_RANK = """
import atexit, os, sys
import torch, torch.distributed as dist
import elastic
from elastic.training.dist import leave_group, rejoin_group

atexit.register(lambda: print("AT EXIT initialized", dist.is_initialized(), flush=True))
elastic.init_process_group(backend="gloo", timeout=30)
for port in sys.argv[1:]:
    leave_group()
    os.environ["MASTER_PORT"] = port
    rejoin_group()
    t = torch.ones(2)
    dist.all_reduce(t)
print("TRAINED", dist.get_world_size(), flush=True)
"""


def test_a_group_left_at_exit_is_destroyed_before_finalization(tmp_path: Path) -> None:
    script = tmp_path / "one.py"
    script.write_text(ONE_RANK)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    ports = [str(free_port()) for _ in range(3)]
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(script), *ports],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["TRAINED 1", "AT EXIT initialized False"], done
        assert "terminate called" not in done.stderr


# The gloo and store threads still running in a worker (a group alive).
THREADS_LEFT = """
def threads_left():
    tasks = os.listdir("/proc/self/task")
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)
"""

# One rank: its group made by elastic or by torch itself, then the first optimizer (which
# imports torch._dynamo, and with it torch.distributed.nn.functional), then the group
# destroyed. Prints the threads still running.
OPTIMIZER_AFTER_GROUP = (
    """
import os, sys
import torch, torch.distributed as dist
import elastic
"""
    + THREADS_LEFT
    + """

if sys.argv[1] == "elastic":
    elastic.init_process_group(backend="gloo", timeout=30)
else:
    dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
torch.optim.SGD(model.parameters(), lr=0.1)
dist.destroy_process_group()
print("LEFT", threads_left(), flush=True)
"""
)


def test_a_group_made_before_the_first_optimizer_is_gone_once_destroyed(tmp_path: Path) -> None:
    """torch.distributed.nn.functional holds the group that exists when it is imported
    (its defaults): then destroy_process_group frees nothing and the group is torn down
    during finalization (``training/dist.py``). Made by elastic, it is gone at once."""
    script = tmp_path / "opt.py"
    script.write_text(OPTIMIZER_AFTER_GROUP)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    left = {}
    for maker in ("elastic", "torch"):
        env["MASTER_PORT"] = str(free_port())
        done = subprocess.run(
            [sys.executable, str(script), maker],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        left[maker] = [line for line in done.stdout.splitlines() if line.startswith("LEFT")]
    assert left["elastic"] == ["LEFT []"], left
    # the torch 2.13 behaviour this guards against (a torch that fixes it fails here: the
    # import in init_process_group can go then)
    assert left["torch"] != ["LEFT []"], left


# Two ranks trained; rank 1 goes (its agent stopped it, or went away) while rank 0 is
# in its last barrier, which raises and ends the script. A handler registered before the
# group was made runs after elastic's: it prints the threads left.
PEER_GONE_IN_THE_LAST_BARRIER = (
    """
import atexit, os, time
import torch, torch.distributed as dist
import elastic
"""
    + THREADS_LEFT
    + """
atexit.register(lambda: print("LEFT", threads_left(), flush=True))
elastic.init_process_group(backend="gloo", timeout=30)
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    os._exit(0)
time.sleep(0.5)
dist.barrier()
"""
)


def test_a_group_whose_last_barrier_failed_is_gone_before_finalization(tmp_path: Path) -> None:
    """The exception the script ended with holds the failed barrier's frames, and they
    the group: the handler at exit frees them with the group, which is gone before the
    interpreter finalizes (gloo's threads would abort the worker there)."""
    script = tmp_path / "gone.py"
    script.write_text(PEER_GONE_IN_THE_LAST_BARRIER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].communicate(timeout=120)
    assert ranks[0].returncode == 1, err  # the barrier's error, not a signal
    assert "Connection closed by peer" in err, err
    assert out.splitlines() == ["LEFT []"], (out, err)
    assert "terminate called" not in err


WORKER = (
    """
import os, sys, time
import torch, torch.distributed as dist
import elastic

STEPS = int(sys.argv[1])
out = os.environ["OUT"]


"""
    + ACCUMULATOR_STATE
    + """
class Accumulator(AccumulatorState):
    def sync(self, world_size, rank):
        every = self.gather_snapshots(world_size)
        self.apply_snapshot(every[elastic.tenured_rank()])


def train_step(s):
    t = torch.tensor([s.step + 1], dtype=torch.int64)
    dist.all_reduce(t)
    s.value = (s.value * 31 + int(t.item()) // dist.get_world_size()) % (2**61 - 1)
    s.step += 1
    open(os.path.join(out, f"step-{os.getpid()}-{dist.get_world_size()}"), "w").close()
    if not os.path.exists(os.path.join(out, "hurry")):  # the test saw the last regroup
        time.sleep(0.1)
    return s.step >= STEPS


elastic.init_process_group(backend="gloo", timeout=60)
state = Accumulator()
last = elastic.train(train_step, state, checkpointer="")
print(f"DONE {last} {state.value} pid={os.getpid()}", flush=True)
# no destroy_process_group: many scripts end like this
"""
)

CONF = "heartbeat_interval=0.5,heartbeat_timeout=2.5,close_timeout=10,last_call_timeout=2"
STEPS = 60
NODES = 4


def stepped_in(out: Path, world: int) -> int:
    """How many worker processes made a step in a world of ``world`` ranks."""
    return len(list(out.glob(f"step-*-{world}")))


def worlds_seen(out: Path) -> set[int]:
    return {int(p.name.rsplit("-", 1)[1]) for p in out.glob("step-*")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_workers_that_regrouped_in_place_exit_zero_with_no_abort_again_and_again(
    procs: Processes, etcd_v3_server: EtcdCluster, tmp_path: Path
) -> None:
    """Four nodes; two are preempted one after the other (two regroups in place); the two
    survivors' workers finish and exit 0, two jobs in a row."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    expected = 0
    for step in range(1, STEPS + 1):
        expected = (expected * 31 + step) % (2**61 - 1)
    for run in range(2):
        out = tmp_path / f"run{run}"
        out.mkdir()
        env = dict(os.environ, PYTHONUNBUFFERED="1", OUT=str(out))
        agents = [
            procs.elastic(
                "run",
                f"--nnodes=2:{NODES}",
                "--nproc-per-node=1",
                "--rdzv-backend=etcd-v3",
                f"--rdzv-endpoint={etcd_v3_server.endpoint}",
                f"--rdzv-id=exit-{run}",
                f"--rdzv-conf={CONF}",
                "--monitor-interval=0.1",
                "--max-restarts=0",
                str(script),
                str(STEPS),
                env=env,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for _ in range(NODES)
        ]
        for world, victim in ((NODES, agents[-1]), (NODES - 1, agents[-2])):
            # every worker of this world made a step in it (not only the first one), so
            # the processes kept through the regroup have all trained in it
            assert wait_until(lambda w=world, o=out: stepped_in(o, w) == w, 90), worlds_seen(out)
            victim.send_signal(signal.SIGTERM)
            assert victim.wait(timeout=40) == 128 + signal.SIGTERM
        # Both survivors stepped in the last world: the rest of the steps, there so the job
        # outlasts the two regroups, run without their pause.
        if wait_until(lambda o=out: stepped_in(o, NODES - 2) == NODES - 2, 90):
            (out / "hurry").touch()
        texts = []
        for agent in agents[:2]:
            text, _ = agent.communicate(timeout=120)
            texts.append(text)
            assert agent.returncode == 0, text
        joined = "\n".join(texts)
        assert "terminate called" not in joined and "SIGABRT" not in joined, joined
        assert joined.count(f"DONE {STEPS} {expected}") == 2, joined
        assert worlds_seen(out) == {NODES, NODES - 1, NODES - 2}, worlds_seen(out)
        # the same two processes trained in all three worlds: kept, never restarted
        kept = {line.rsplit("pid=", 1)[1] for line in joined.splitlines() if "DONE" in line}
        for pid in kept:
            assert {
                w for w in (NODES, NODES - 1, NODES - 2) if (out / f"step-{pid}-{w}").exists()
            } == {
                NODES,
                NODES - 1,
                NODES - 2,
            }, pid
