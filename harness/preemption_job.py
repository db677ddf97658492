"""The preemption job on a simulated cluster (``tests/test_preemption_multihost.py``,
``bench/preemption.py``): a DDP worker that checkpoints on a preemption notice
(``PREEMPT_WORKER``), the events it writes (``read_events``, ``last_step``) and the job
that runs it on every host (``preempt_job``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastic.harness.cluster import Cluster
from elastic.harness.multihost import START_RECORD, FaultJob, c10d_script_job
from elastic.testing.waits import wait_until

# It writes the same start record as ``WORKER``, timed before any import (so
# ``FaultJob.running_together`` and ``regroup_time`` work), then one JSON line per event to
# ``FAULTS_OUT/events.jsonl`` (``read_events``): "start" (the step it resumes from, after
# ``init_process_group``), "step" (a step completed), "saved" (after the barrier that
# follows rank 0's atomic save; ``why`` "notice" or "every"), "done"; each with the time,
# host, pid, rank, world and restart count. Rank 0 writes ``CKPT_DIR/final.json`` (step,
# world, weights) at the end. The global batch depends on the step only and splits evenly
# over 1, 2 or 3 nodes, so any regrouping gives the reference's weights. A file
# ``FAULTS_OUT/hurry`` drops the pause between steps (``hurry_once``): a test that saw what
# it waited for runs the rest of the steps, there so the job outlasts it, at once.
PREEMPT_WORKER = (
    """\
import faulthandler, json, os, socket, sys, time
t0 = time.time()  # the start record's time: before torch is imported
faulthandler.enable()  # a C++ abort in torch (seen once at exit) shows where in Python
import torch


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def weights(model):
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


if sys.argv[1] == "--reference":
    model, opt = model_and_opt()
    for step in range(int(sys.argv[2])):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    print(json.dumps(weights(model)))
    sys.exit(0)

import datetime
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import elastic

"""
    + START_RECORD
    + """\
events = os.open(os.path.join(out, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def note(event, step, **kw):
    line = dict(rec, t=time.time(), event=event, step=step, **kw)
    os.write(events, (json.dumps(line) + "\\n").encode())  # one O_APPEND write per line


ckpt_dir, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pause = float(sys.argv[4])
# Before the group: the first optimizer imports torch.distributed.nn.functional, which
# would hold a group made before it past destroy_process_group (elastic/training/dist.py).
model, _ = model_and_opt()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
ckpt = os.path.join(ckpt_dir, "ckpt.pt")
step = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    step = state["step"]
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
note("start", step)
while step < steps:
    x, y = batch(step)
    share = 12 // world
    opt.zero_grad()
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    torch.nn.functional.mse_loss(ddp(xs), ys).backward()
    opt.step()
    step += 1
    note("step", step)
    if not os.path.exists(os.path.join(out, "hurry")):  # a test saw what it waited for
        time.sleep(pause)
    flag = torch.tensor([int(elastic.checkpoint_requested())])  # False under torchrun
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank saves at this one step
    if flag.item() or (every > 0 and step % every == 0):
        if rank == 0:
            torch.save({"model": model.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)  # atomic: never a partial checkpoint
        dist.barrier()
        note("saved", step, why="notice" if flag.item() else "every")
        if flag.item():
            elastic.checkpoint_saved()  # waits for the agent to stop this worker
note("done", step)
if rank == 0:
    with open(os.path.join(ckpt_dir, "final.json"), "w") as f:
        json.dump({"step": step, "world": world, "weights": weights(model)}, f)
del ddp  # before the group: see examples/ddp_train.py (a gloo hang or abort at exit)
dist.destroy_process_group()
"""
)


def read_events(workdir: Path) -> list[dict[str, Any]]:
    """The events ``PREEMPT_WORKER``s wrote under ``workdir``, oldest first."""
    path = workdir / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written right now
            continue
    return sorted(records, key=lambda r: r["t"])


def hurry_once(
    workdir: Path, hosts: set[str], world: int, since: float, timeout: float = 90.0
) -> None:
    """Once a worker on every host of ``hosts`` (names) completed a step in a
    ``world``-rank job after ``since``, the workers drop their pause (``hurry`` in
    ``workdir``, their ``FAULTS_OUT``). Not seen before the job ends or within ``timeout``:
    the job keeps its pace and the test's assertions say why."""
    over: list[bool] = []

    def seen() -> bool:
        events = [e for e in read_events(workdir) if e["t"] > since]
        stepped = {e["host"] for e in events if e["event"] == "step" and e["world"] == world}
        if hosts <= stepped:
            over.append(True)
        return bool(over) or any(e["event"] == "done" for e in events)

    wait_until(seen, timeout, 0.2)
    if over:
        (workdir / "hurry").touch()


def last_step(seen: list[dict[str, Any]], world: int) -> int:
    """The last step completed by any rank of a ``world``-rank round (``read_events``)."""
    return max((e["step"] for e in seen if e["event"] == "step" and e["world"] == world), default=0)


def preempt_job(
    cluster: Cluster,
    workdir: Path,
    *,
    steps: int,
    every: int,
    pause: float,
    nnodes: str,
    args: list[str],
    launcher: str = "ours",
    env: dict[str, str] | None = None,
) -> FaultJob:
    """A c10d job of ``PREEMPT_WORKER``s on every host of ``cluster`` (not started),
    checkpointing under ``workdir/ckpt``; ``args`` the launcher flags (restarts, grace)."""
    ckpt = workdir / "ckpt"
    ckpt.mkdir(parents=True)
    return c10d_script_job(
        cluster,
        workdir,
        PREEMPT_WORKER,
        [str(ckpt), str(steps), str(every), str(pause)],
        run_id="preempt",
        nnodes=nnodes,
        args=args,
        launcher=launcher,
        env=env,
    )
