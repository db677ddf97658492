"""A kept worker whose next round loses a rank while the ranks connect (after they met
at the round's store) keeps its state: it asks for the job to re-form and joins the
round after (``elastic.training.regroup``), on a real gloo group of local processes with
a control file as if on its own node (the test is its agent, and the rank that goes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from elastic.core.interfaces.rendezvous import RendezvousError
from elastic.core.tcpstore import TCPStoreClient
from elastic.core.workers.control_file import ControlFile
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until
from elastic.training.bounded import MEET_KEY

WORKER = """
import os, sys
import torch, torch.distributed as dist
from elastic.training import regroup
from elastic.training.dist import init_process_group

init_process_group("gloo", timeout=4)  # a group of one, its connect bounded by 4 s
assert regroup.opt_in()
print("WAITING", flush=True)
world_size, rank = regroup.regroup()
t = torch.ones(1)
dist.all_reduce(t)
print("REGROUPED", world_size, rank, int(t.item()), flush=True)
"""


def round_vars(port: int, world_size: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": str(world_size),
    }


def count_in(port: int) -> bool:
    """Count a rank in at the round's store once the kept worker hosts it."""
    try:
        store = TCPStoreClient("127.0.0.1", port, timeout=5, torch_ok=True)
    except RendezvousError:  # not listening yet
        return False
    try:
        store.add(MEET_KEY, 1)
    finally:
        store.close()
    return True


@pytest.mark.timeout(120)
def test_a_rank_gone_while_the_round_connects_costs_the_kept_worker_nothing(
    tmp_path: Path,
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    control = ControlFile(1, str(tmp_path))
    env = dict(os.environ, LOCAL_RANK="0", **round_vars(free_port(), 1), **control.worker_env(0))
    out = tmp_path / "out"
    with open(out, "w") as stdout, open(tmp_path / "err", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script)], env=env, stdout=stdout, stderr=stderr
        )
    try:
        assert wait_until(lambda: "WAITING" in out.read_text(), 90), out.read_text()
        # A round of two: the other rank counts itself in at the round's store, then is
        # gone before it connects (its host died).
        port = free_port()
        control.request_regroup()
        generation = control.hand_over({0: round_vars(port, 2)})
        assert wait_until(lambda: count_in(port), 60), (tmp_path / "err").read_text()
        # The kept worker asks for the job to re-form (its slot "broken") ...
        assert wait_until(control.broken, 60), (tmp_path / "err").read_text()
        assert control.joined(generation) == {0}
        # ... and joins the next round with its process and state.
        control.hand_over({0: round_vars(free_port(), 1)})
        assert proc.wait(timeout=60) == 0, (tmp_path / "err").read_text()
        assert out.read_text().splitlines() == ["WAITING", "REGROUPED 1 0 1"]
        assert f"joining round {generation} failed" in (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        control.close()
