"""DDP training in torchrun's recommended shape: load_checkpoint -> train -> save_checkpoint.

    elastic run --standalone --nproc-per-node=2 --max-restarts=3 examples/ddp_train.py \\
        --checkpoint-dir /tmp/ckpt --out /tmp/params.json

Deterministic: fixed seeds and fixed synthetic data, where step i always sees the same
batch, so a run that is killed and resumed from a checkpoint ends with bit-identical
parameters to one that never failed. gloo on CPU, nccl on GPU. Checkpoints go through
elastic's ``fs`` checkpointer (temp file + fsync + rename; only rank 0 writes); without
``--checkpoint-dir`` the launcher's ``--checkpoint`` (``ELASTIC_CHECKPOINT``) is used.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path
from typing import IO

import elastic
import torch
import torch.distributed as dist
from elastic.core import checkpoint as ckpt
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SAMPLES, FEATURES, BATCH = 256, 8, 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the final parameters here (JSON)")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to pause per step")
    parser.add_argument("--progress-dir", default=None, help="write rank<N>.json (pid, step)")
    return parser.parse_args(argv)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every rank and every restart starts from the same S_0
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return x, torch.sin(x @ w) + 0.1 * torch.randn(SAMPLES, 1, generator=g)


def batch_for(step: int, rank: int, world: int, data: tuple[torch.Tensor, torch.Tensor]):  # noqa: ANN201
    """Step ``step``'s batch depends only on the step: a resumed run replays it exactly."""
    idx = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + step))[:BATCH]
    idx = idx[rank::world]
    return data[0][idx], data[1][idx]


def write_progress(directory: str | None, rank: int, step: int) -> None:
    """For monitors and chaos tests: which pid is at which step, written atomically."""
    if not directory:
        return
    path = Path(directory) / f"rank{rank}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "rank": rank}))
    os.replace(tmp, path)


def write_params(path: str, model: nn.Module, step: int) -> None:
    """Parameters as float.hex strings: equal files mean bit-identical parameters."""
    params = {
        name: [float(v).hex() for v in p.detach().cpu().double().flatten().tolist()]
        for name, p in model.state_dict().items()
    }
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"step": step, "params": params}, sort_keys=True))
    os.replace(tmp, path)


def get_checkpointer(directory: str | None) -> ckpt.Checkpointer | None:
    return ckpt.load_checkpointer(f"fs:{directory}") if directory else ckpt.checkpointer_from_env()


def load_checkpoint(
    saver: ckpt.Checkpointer | None, model: nn.Module, opt: torch.optim.Optimizer
) -> int:
    """Restore model and optimizer from the newest complete checkpoint; return its step."""
    if saver is None:
        return 0

    def read(stream: IO[bytes]) -> None:
        state = torch.load(stream, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])

    return saver.load_latest(read) or 0


def save_checkpoint(
    saver: ckpt.Checkpointer | None, step: int, model: nn.Module, opt: torch.optim.Optimizer
) -> None:
    if saver is None:
        return
    buf = io.BytesIO()  # serialize once, outside the checkpointer's timed write
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, buf)
    saver.save(step, lambda stream: stream.write(buf.getbuffer()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backend = elastic.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    saver = get_checkpointer(args.checkpoint_dir)
    start = load_checkpoint(saver, model, opt)  # every rank reads the same checkpoint
    ddp = DDP(model.to(device) if device else model, device_ids=[device] if device else None)
    data = dataset()
    if rank == 0:
        print(f"ddp_train: world={world} backend={backend} resuming at step {start}", flush=True)

    loss_fn = nn.MSELoss()
    loss = torch.tensor(float("nan"))  # a run resumed at its last step trains no more
    for step in range(start + 1, args.steps + 1):
        x, y = batch_for(step, rank, world, data)
        if device is not None:
            x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()  # DDP averages gradients across ranks here
        opt.step()
        write_progress(args.progress_dir, rank, step)
        if rank == 0 and (step % args.checkpoint_every == 0 or step == args.steps):
            save_checkpoint(saver, step, model, opt)
            elastic.put_metric("loss", loss.item(), group="ddp_train")
        if args.sleep:
            time.sleep(args.sleep)

    if rank == 0:
        print(f"ddp_train: finished {args.steps} steps, last loss {loss.item():.6f}", flush=True)
    if rank == 0 and args.out:
        write_params(args.out, model, args.steps)
    dist.barrier()  # every rank is done with its collectives before the group goes away
    # DDP's reducer holds the process group, and its destructor runs holding the GIL; had
    # it dropped the group's last reference, ProcessGroupGloo's destructor would join a
    # gloo thread that needs the GIL: a worker hung at exit (about 1 run in 4 here). Freed
    # first, the group's last reference goes with destroy_process_group, which releases it.
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
