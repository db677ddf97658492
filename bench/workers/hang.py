import time

T0 = time.time()  # the first statement: the worker's start time, before any other import

import json  # noqa: E402 - deliberately after the timestamp
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# (No module docstring above: the timestamp must be the very first statement.)
# A hang for bench/hang.py: gloo DDP-style steps, then on attempt 0 rank 1 sleeps forever
# instead of joining the next all_reduce, while rank 0 waits in it. Later attempts finish.
#
# usage: hang.py OUT_DIR GLOO_TIMEOUT_SECONDS


def record(out_dir: str, kind: str, stamp: float) -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank = os.environ.get("RANK", "?")
    path = os.path.join(out_dir, f"{kind}-{attempt}-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"t": stamp, "attempt": int(attempt), "rank": rank}, f)
    os.replace(path + ".tmp", path)  # atomic: the bench never reads half a file


def main() -> int:
    out_dir, gloo_timeout = sys.argv[1], float(sys.argv[2])
    record(out_dir, "start", T0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=gloo_timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    t = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(t)
    if attempt == "0" and dist.get_rank() == 1:
        record(out_dir, "hang", time.time())
        time.sleep(10**6)  # never reaches the all_reduce below
    dist.all_reduce(t)
    dist.destroy_process_group()
    record(out_dir, "done", time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
