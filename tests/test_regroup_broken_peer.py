"""A worker whose group broke under it (a peer died mid-collective) frees the group when it
leaves, although it waits for the next round inside its ``except`` block: the exception's
traceback holds torch's collective frame, and with it the group and its connections. Held,
a rank blocked in the same collective with it (not with the dead peer) never sees a closed
connection and waits out the collective timeout; the agent, bounded far below that, then
restarts the kept worker (a new pid after an in-place regroup of four nodes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from elastic.testing.ports import free_port

# Rank 0 dies after one all_reduce; the others are in the next one. Each survivor that
# sees the group break leaves it from inside its except block, as elastic.train does on
# its way to the next round, and stays there until every survivor saw the break (a file
# each in OUT), longer than the collective timeout at most: a survivor still holding the
# group keeps a peer waiting until that peer's timeout, and stays that long too.
RANK = """
import os, sys, time, datetime
import torch, torch.distributed as dist
from elastic.training.dist import leave_group

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
dist.all_reduce(torch.ones(1))
if rank == 0:
    time.sleep(0.5)
    os._exit(1)
try:
    dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX)
    print("NOT BROKEN", flush=True)
except RuntimeError as broke:
    print("BROKE", "timed out" if "imed out" in str(broke) else "closed", flush=True)
    leave_group()
    out = os.environ["OUT"]
    open(os.path.join(out, f"broke-{rank}"), "w").close()
    end = time.monotonic() + TIMEOUT + 2
    while time.monotonic() < end and len(os.listdir(out)) < 3:
        time.sleep(0.05)
"""
TIMEOUT = 8


@pytest.mark.timeout(120)
def test_a_rank_that_left_a_broken_group_closes_its_connections(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK.replace("TIMEOUT", str(TIMEOUT)))
    port = str(free_port())
    out = tmp_path / "broke"
    out.mkdir()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(r),
                WORLD_SIZE="4",
                OUT=str(out),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(4)
    ]
    outputs = [p.communicate(timeout=90)[0].strip() for p in ranks]
    # Every survivor saw a closed connection: the one that is no neighbour of the dead
    # rank in gloo's ring learns it from its neighbours leaving, not from a timeout.
    assert outputs[1:] == ["BROKE closed"] * 3, outputs
