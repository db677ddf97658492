import time

T0 = time.time()  # the first statement: the worker's start time, before any other import

import json  # noqa: E402 - deliberately after the timestamp
import os  # noqa: E402
import sys  # noqa: E402

# (No module docstring above: the timestamp must be the very first statement.)
# A benchmark worker for bench/agents_c10d.py: records when it started, then joins a gloo
# process group from the launcher's environment (env://), does one all_reduce of its rank,
# checks the sum and destroys the group.
#
# usage: allreduce.py OUT_DIR   writes OUT_DIR/start-<rank>.json and OUT_DIR/done-<rank>.json


def record(out_dir: str, kind: str, payload: dict[str, object]) -> None:
    rank = os.environ.get("RANK", "?")
    path = os.path.join(out_dir, f"{kind}-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"kind": kind, "rank": rank, "pid": os.getpid(), **payload}, f)
    os.replace(path + ".tmp", path)  # atomic: the bench never reads half a file


def main() -> int:
    out_dir = sys.argv[1]
    record(out_dir, "start", {"t": T0})
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    expected = world * (world - 1) / 2
    dist.destroy_process_group()
    record(out_dir, "done", {"t": time.time(), "sum": value.item(), "world": world})
    if value.item() != expected:
        print(f"allreduce: rank {rank} got {value.item()}, expected {expected}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
