"""DDP that keeps its processes through membership changes: ``elastic.membership_changed()``
and ``elastic.regroup()``, for scripts that do not use the State API.

    elastic run --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=H:29400 \\
        examples/ddp_regroup.py --steps 200 --out /tmp/params.json

Every step the ranks agree, with one all_reduce, on whether the job is re-forming (a node
was preempted, died or joins). Then every rank, at that same step, drops its DDP wrapper
(it is bound to the old group), calls ``elastic.regroup()`` (the process group is made
again in the agent's new round: new ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), and
takes the state from rank 0 (``sync``): rank 0 of a round is always a node of the last
one, since members keep their order and newcomers come last. A new node's workers start
the usual way and call the same ``sync`` after ``elastic.init_process_group``.

A collective that fails because a peer died raises out of the step: the ranks roll back
to the state before the step and call ``elastic.regroup(broken=True)``. Outside
``elastic run`` (torchrun) ``membership_changed()`` is always False and nothing changes.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import elastic
import torch
import torch.distributed as dist
from ddp_train import batch_for, dataset, make_model, write_params, write_progress
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def sync(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> int:
    """Everyone takes rank 0's model, optimizer and step (new ranks catch up)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box = [{"model": model.state_dict(), "opt": opt.state_dict(), "step": step}]
    dist.broadcast_object_list(box, src=0)
    model.load_state_dict(box[0]["model"])
    opt.load_state_dict(box[0]["opt"])
    return int(box[0]["step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--progress-dir", default=None)
    args = parser.parse_args()

    elastic.init_process_group(backend="gloo")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data, loss_fn = dataset(), nn.MSELoss()
    step = sync(model, opt, 0)
    ddp = DDP(model)
    while step < args.steps:
        rank, world = dist.get_rank(), dist.get_world_size()
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        try:
            x, y = batch_for(step + 1, rank, world, data)
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp(x), y).backward()  # DDP averages gradients across ranks here
            opt.step()
            flag = torch.tensor([int(elastic.membership_changed())])  # cheap: shared memory
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at one step
        except RuntimeError:  # a peer died mid-collective (gloo: connection closed)
            model.load_state_dict(saved[0])  # this step is redone in the new world
            opt.load_state_dict(saved[1])
            del ddp
            elastic.regroup(broken=True)
            step = sync(model, opt, step)
            ddp = DDP(model)
            continue
        step += 1
        write_progress(args.progress_dir, rank, step)
        if args.sleep:
            time.sleep(args.sleep)
        if flag.item():
            del ddp  # bound to the old group
            elastic.regroup()
            step = sync(model, opt, step)
            ddp = DDP(model)
    if dist.get_rank() == 0 and args.out:
        write_params(args.out, model, step)
    dist.barrier()
    del ddp  # before the group: see ddp_train.py
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
