"""The same training as ddp_train.py, written on elastic's State / train_step API.

    elastic run --standalone --nproc-per-node=2 --max-restarts=3 --checkpoint fs:/tmp/ckpt \\
        examples/state_train.py --out /tmp/params.json

``TrainState`` knows how to snapshot itself (rollback of a failed step, and the default
checkpoint format) and how to ``sync``: the rank ``elastic.tenured_rank()`` names (the
most recent state: the highest step, the lowest rank on ties) broadcasts it, so workers
that start without a checkpoint on their disk catch up; ``elastic.train`` goes on from
that rank's step and checks that every rank then holds its state. ``elastic.train``
loads the newest checkpoint at every start, calls ``sync``, then runs ``train_step``
until it returns True. Under ``elastic run`` a node leaving or joining does not restart
these workers: ``elastic.train`` re-forms the process group in the new round and calls
``sync`` again (the new workers catch up).
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


class TrainState(elastic.State):
    def __init__(self, steps: int, lr: float) -> None:
        self.steps = steps
        self.step = 0
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.data = dataset()  # derived from a seed: never snapshotted

    def capture_snapshot(self) -> Any:
        return {
            "step": self.step,
            "model": copy.deepcopy(self.model.state_dict()),
            "opt": copy.deepcopy(self.opt.state_dict()),
        }

    def apply_snapshot(self, snapshot: Any) -> None:
        # A setter, not an update: correct whatever state it is applied to.
        self.step = snapshot["step"]
        self.model.load_state_dict(snapshot["model"])
        self.opt.load_state_dict(snapshot["opt"])

    def sync(self, world_size: int, rank: int) -> None:
        if world_size == 1 or not dist.is_initialized():
            return
        source = elastic.tenured_rank()  # the job goes on from its step number
        box = [self.capture_snapshot() if rank == source else None]
        dist.broadcast_object_list(box, src=source)
        if rank != source:
            self.apply_snapshot(box[0])


def make_train_step(progress_dir: str | None, sleep: float):  # noqa: ANN201
    loss_fn = nn.MSELoss()

    def train_step(state: TrainState) -> bool:
        if state.step >= state.steps:  # resumed from the final checkpoint: nothing left
            return True
        rank, world = dist.get_rank(), dist.get_world_size()
        step = state.step + 1
        x, y = batch_for(step, rank, world, state.data)
        state.opt.zero_grad(set_to_none=True)
        loss_fn(state.model(x), y).backward()
        for p in state.model.parameters():  # synchronous SGD: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        state.opt.step()
        state.step = step
        write_progress(progress_dir, rank, step)
        if sleep:
            time.sleep(sleep)
        return step >= state.steps

    return train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--progress-dir", default=None)
    args = parser.parse_args()

    elastic.init_process_group(backend="gloo")  # the state and its gradients live on CPU
    state = TrainState(args.steps, args.lr)
    checkpointer = f"fs:{args.checkpoint_dir}" if args.checkpoint_dir else None
    elastic.train(
        make_train_step(args.progress_dir, args.sleep),
        state,
        checkpointer=checkpointer,  # None: the launcher's --checkpoint (ELASTIC_CHECKPOINT)
        checkpoint_every=args.checkpoint_every,
    )
    if dist.get_rank() == 0 and args.out:
        write_params(args.out, state.model, state.step)
    dist.barrier()  # every rank is done with its collectives before the group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
