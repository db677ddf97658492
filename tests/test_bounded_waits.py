"""A regrouping worker's waits never outlast its agent's newer round: ``elastic.train``'s
step agreement (``elastic.training.bounded``) and the script's own collective
(``elastic.training.sever``), on real gloo groups of local processes, each with a
control file of its own as if on its own node (the test is their agents).

Rank 2 stops (SIGSTOP): a peer gone without closing its connections, as a host cut off.
Ranks 0 and 1 wait for it in the step agreement, or in an all_reduce: they keep waiting
while no newer round is handed over (a slow peer is no reason to give up), give up within
a few seconds once one is, leave the group soon (a group whose gloo thread still waits is
kept, not destroyed under it) and exit 0 without waiting out gloo's timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic.core.workers.control_file import ControlFile
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until

# A rank that waits with its peers, rank 2 stopped; {init} makes its group, {wait} waits.
RANK = """
import datetime, os, signal, sys, time
import torch, torch.distributed as dist
from elastic.training import loop, regroup
from elastic.training.bounded import RoundMoved
from elastic.training.dist import init_process_group, leave_group

rank = int(os.environ["RANK"])
{init}
assert regroup.opt_in()
dist.all_reduce(torch.ones(1))
if rank == 2:
    os.kill(os.getpid(), signal.SIGSTOP)
print("WAITING", flush=True)
try:
    {wait}
    print("DONE", flush=True)
except RoundMoved:
    print("MOVED", time.time(), flush=True)
except RuntimeError as exc:
    print("BROKE", time.time(), flush=True)
    print(repr(exc), file=sys.stderr)
started = time.monotonic()
leave_group()
print("LEFT %.2f" % (time.monotonic() - started), flush=True)
"""
GLOO_TIMEOUT = 120  # s: far past every bound below


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def three_ranks_one_stopped(tmp_path: Path, source: str, *, lost: bool = False) -> list[list[str]]:
    """Runs ``source`` as ranks 0-2, each with a control file of its own; rank 2 stops
    itself. Once ranks 0 and 1 print WAITING, and still after ``GIVE_UP_LATER`` s without
    a newer round, their agents hand one over (``lost``: say instead that the round lost
    a member, as when rank 2's node is found gone); returns what the two printed, each line
    with the time since that hand-over (or word) where the line gives one."""
    script = tmp_path / "rank.py"
    script.write_text(source.replace("GLOO_TIMEOUT", str(GLOO_TIMEOUT)))
    port = str(free_port())
    controls = [ControlFile(1, str(tmp_path)) for _ in range(3)]
    procs, outs = [], []
    try:
        for rank, control in enumerate(controls):
            out = tmp_path / f"out-{rank}"
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            env.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="3", **control.worker_env(0))
            with open(out, "w") as stdout, open(tmp_path / f"err-{rank}", "w") as stderr:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script)], env=env, stdout=stdout, stderr=stderr
                    )
                )
            outs.append(out)
        survivors = outs[:2]
        assert wait_until(lambda: all("WAITING" in lines(o) for o in survivors), 90)
        time.sleep(GIVE_UP_LATER)  # no newer round: they wait on
        assert all(lines(o) == ["WAITING"] for o in survivors), [lines(o) for o in survivors]
        handed = time.time()
        for control in controls[:2]:
            if lost:
                control.request_regroup(lost=True)
            else:
                control.hand_over({0: {}})
        for proc in procs[:2]:
            assert proc.wait(timeout=60) == 0, [lines(o) for o in outs]
        for rank in (0, 1):
            assert "terminate called" not in (tmp_path / f"err-{rank}").read_text()
        printed = []
        for out in survivors:
            rows = []
            for line in lines(out):
                word, *rest = line.split()
                rows.append(f"{word} {float(rest[0]) - handed:.2f}" if word in TIMED else line)
            printed.append(rows)
        return printed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        for control in controls:
            control.close()


TIMED = ("MOVED", "BROKE")  # lines whose number is a time.time()


def gave_up_in_time(line: str, word: str, within: tuple[float, float] = (2.0, 15)) -> None:
    """``word`` came 2 s after the hand-over (plus a step: none yet), far below gloo's
    timeout; loaded machines lag."""
    name, after = line.split()
    assert name == word and within[0] <= float(after) < within[1], line


# (init, wait, word): how a rank makes its group, what it waits in, what it prints then.
# elastic.train's step agreement, bounded (torch's own init: nothing to cut): the group,
# whose gloo thread still waits, is kept and left at once.
STEP_AGREEMENT = (
    "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=GLOO_TIMEOUT))",
    "loop._all_reduce_max([1, 0])",
    "MOVED",
)
# The script's own collective: freed by cutting its group's connections (sever).
OWN_COLLECTIVE = (
    "init_process_group('gloo', timeout=GLOO_TIMEOUT)",
    "dist.all_reduce(torch.ones(1))",
    "BROKE",
)
WAIT_IDS = ["step-agreement", "own-collective"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("init", "wait", "word", "leaves_within"),
    [(*STEP_AGREEMENT, 1.0), (*OWN_COLLECTIVE, 5.0)],
    ids=WAIT_IDS,
)
def test_a_wait_with_a_gone_peer_ends_once_a_newer_round_comes(
    tmp_path: Path, init: str, wait: str, word: str, leaves_within: float
) -> None:
    source = RANK.replace("{init}", init).replace("{wait}", wait)
    for rows in three_ranks_one_stopped(tmp_path, source):
        waiting, gave_up, left = rows
        assert waiting == "WAITING", rows
        gave_up_in_time(gave_up, word)
        assert float(left.split()[1]) < leaves_within, left


GIVE_UP_LATER = 3.0  # s without a newer round: longer than the wait once one comes


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("init", "wait", "word"), [STEP_AGREEMENT, OWN_COLLECTIVE], ids=WAIT_IDS)
def test_a_wait_with_a_peer_found_gone_ends_at_once(
    tmp_path: Path, init: str, wait: str, word: str
) -> None:
    """The agents found rank 2's node gone (its round lost a member): the others give up
    before any newer round is handed over, not its grace later."""
    source = RANK.replace("{init}", init).replace("{wait}", wait)
    for rows in three_ranks_one_stopped(tmp_path, source, lost=True):
        waiting, gave_up, _ = rows
        assert waiting == "WAITING", rows
        gave_up_in_time(gave_up, word, within=(0.0, 1.5))
