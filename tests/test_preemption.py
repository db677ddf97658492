"""Preemption without lost work: on a notice the whole job checkpoints at one step, the
notified node leaves, and the survivors resume from that step (real agents, c10d on
loopback, gloo workers). The multi-host variant is in tests/test_faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic.harness.commands import write_script
from elastic.harness.processes import Processes
from elastic.testing.ports import free_port
from elastic.testing.waits import wait_until

# A DDP-shaped loop with no periodic checkpoint: it saves only when the job asks.
DDP_SCRIPT = """
    import json, os, sys, time
    import torch, torch.distributed as dist
    import elastic

    ckpt, log, target = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"step": 0, "w": 0.0}

    def note(**kw):
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "rank": rank, "world": dist.get_world_size(),
                                "restarts": os.environ["TORCHELASTIC_RESTART_COUNT"], **kw}))
            f.write("\\n")

    note(event="start", step=state["step"])
    step, w = state["step"], state["w"]
    while step < target:
        t = torch.ones(1)
        dist.all_reduce(t)
        step, w = step + 1, w + t.item()
        note(event="step", step=step)
        if not os.path.exists(log + ".hurry"):  # the test saw the survivor alone
            time.sleep(0.2)
        flag = torch.tensor([int(elastic.checkpoint_requested())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            if rank == 0:
                with open(ckpt + ".tmp", "w") as f:
                    json.dump({"step": step, "w": w}, f)
                os.replace(ckpt + ".tmp", ckpt)
            dist.barrier()
            note(event="saved", step=step)
            elastic.checkpoint_saved()
    note(event="done", step=step)
    dist.destroy_process_group()
"""


def events(log: Path) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def start_node(procs: Processes, port: int, *args: str, grace: str = "20") -> subprocess.Popen[str]:
    return procs.elastic(
        "run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=preempt",
        "--rdzv-conf=last_call_timeout=1,heartbeat_interval=0.5,heartbeat_timeout=3",
        f"--preemption-grace={grace}",
        "--monitor-interval=0.05",
        *args,
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_preempted_node_checkpoints_the_job_then_leaves(procs: Processes, tmp_path: Path) -> None:
    script = write_script(tmp_path, "ddp.py", DDP_SCRIPT)
    ckpt, log = tmp_path / "ckpt.json", tmp_path / "events.jsonl"
    port = free_port()
    args = (str(ckpt), str(log), "40")
    host = start_node(procs, port, script, *args)
    assert wait_until(lambda: port_open(port), 60)
    leaver = start_node(procs, port, script, *args)
    assert wait_until(lambda: max_step(events(log), world=2) >= 5, 90), events(log)[-5:]
    noticed = time.monotonic()
    leaver.send_signal(signal.SIGTERM)
    _, err = leaver.communicate(timeout=60)
    left_after = time.monotonic() - noticed
    assert leaver.returncode == 128 + signal.SIGTERM, err
    assert "checkpoint is complete" in err, err
    # Released as soon as the save completed, long before the 20 s grace.
    assert left_after < 10, left_after
    hurry_once_alone(log)
    out, err = host.communicate(timeout=90)
    assert host.returncode == 0, err
    seen = events(log)
    saved = [e for e in seen if e["event"] == "saved"]
    assert {e["step"] for e in saved} == {saved[0]["step"]}, saved  # one step, every rank
    assert len(saved) == 2  # one coordinated save: both ranks, once
    before = max(int(e["step"]) for e in seen if e["event"] == "step" and e["world"] == 2)
    resumed = [e for e in seen if e["event"] == "start" and e["world"] == 1]
    assert resumed and resumed[0]["step"] == saved[0]["step"], seen
    assert before - int(saved[0]["step"]) <= 1  # at most one step redone
    assert {e["restarts"] for e in seen} == {"0"}  # a departure spends no restart
    assert any(e["event"] == "done" and e["step"] == 40 for e in seen)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_that_does_not_listen_is_not_kept_waiting(
    procs: Processes, tmp_path: Path
) -> None:
    script = write_script(
        tmp_path, "sleepy.py", "import time\nprint('UP', flush=True)\ntime.sleep(600)\n"
    )
    proc = procs.elastic("run", "--standalone", "--preemption-grace=30", script)
    assert proc.stdout is not None
    assert "UP" in proc.stdout.readline()
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert time.monotonic() - started < 5  # not the 30 s grace


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_grace_too_short_leaves_anyway_and_says_so(procs: Processes, tmp_path: Path) -> None:
    # The worker listens but never saves: the agent leaves when the grace runs out.
    script = write_script(
        tmp_path,
        "stubborn.py",
        """
        import time, elastic
        print("UP", flush=True)
        while True:
            elastic.checkpoint_requested()
            time.sleep(0.05)
        """,
    )
    proc = procs.elastic("run", "--standalone", "--preemption-grace=2", script)
    assert proc.stdout is not None
    assert "UP" in proc.stdout.readline()
    time.sleep(0.3)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - started
    assert proc.returncode == 128 + signal.SIGTERM
    assert 1.5 < took < 10, took
    assert "no complete checkpoint within the grace" in err, err


def test_bad_preemption_flags_are_one_line(tmp_path: Path) -> None:
    script = write_script(tmp_path, "noop.py", "pass\n")
    for flag, word in (
        ("--preemption-grace=-1", "grace"),
        ("--preemption-signal=SIGNOPE", "signal"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "elastic", "run", "--standalone", flag, script],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert word in result.stderr and "Traceback" not in result.stderr


def port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def max_step(seen: list[dict[str, object]], world: int) -> int:
    steps = [int(e["step"]) for e in seen if e["event"] == "step" and e["world"] == world]
    return max(steps, default=0)


def hurry_once_alone(log: Path) -> None:
    """Once the survivor made a step alone (world 1), the rest of its steps, there so the
    job outlasts the notice, run without their pause (a file next to ``log``)."""
    alone = lambda: max_step(events(log), world=1) > 0  # noqa: E731
    ended = lambda: any(e["event"] == "done" for e in events(log))  # noqa: E731
    if wait_until(lambda: alone() or ended(), 60) and alone():
        Path(f"{log}.hurry").touch()


def test_outside_elastic_run_the_api_is_a_no_op() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_CONTROL_FILE"}
    code = (
        "import time, elastic; assert elastic.checkpoint_requested() is False; "
        "t = time.monotonic(); elastic.checkpoint_saved(); assert time.monotonic() - t < 1"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


STATE_SCRIPT = """
    import json, os, sys, time
    import torch.distributed as dist
    import elastic

    log, target = sys.argv[1], int(sys.argv[2])
    elastic.init_process_group("gloo")

    class Counter(elastic.State):
        def __init__(self):
            self.step = 0
        def capture_snapshot(self):
            return {"step": self.step}
        def apply_snapshot(self, snapshot):
            self.step = snapshot["step"]
        def sync(self, world_size, rank):
            pass

    def note(**kw):
        with open(log, "a") as f:
            f.write(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                                "restarts": os.environ["TORCHELASTIC_RESTART_COUNT"], **kw}))
            f.write("\\n")

    state = Counter()

    def train_step(s):
        s.step += 1
        note(event="step", step=s.step)
        if not os.path.exists(log + ".hurry"):  # the test saw the survivor alone
            time.sleep(0.2)
        return s.step >= target

    done = elastic.train(train_step, state, checkpoint_every=10_000)
    note(event="done", step=done)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_state_api_saves_on_notice_by_itself(procs: Processes, tmp_path: Path) -> None:
    script = write_script(tmp_path, "state.py", STATE_SCRIPT)
    log = tmp_path / "events.jsonl"
    port = free_port()
    extra = ("--checkpoint", f"fs:{tmp_path / 'ckpt'}")
    host = start_node(procs, port, *extra, script, str(log), "40")
    assert wait_until(lambda: port_open(port), 60)
    leaver = start_node(procs, port, *extra, script, str(log), "40")
    assert wait_until(lambda: max_step(events(log), world=2) >= 5, 90), events(log)[-5:]
    leaver.send_signal(signal.SIGTERM)
    _, err = leaver.communicate(timeout=60)
    assert "checkpoint is complete" in err, err
    hurry_once_alone(log)
    _, err = host.communicate(timeout=90)
    assert host.returncode == 0, err
    seen = events(log)
    before = max_step(seen, world=2)
    after = [int(e["step"]) for e in seen if e["event"] == "step" and e["world"] == 1]
    # The survivor resumed from the step the job saved at: at most one step is redone.
    assert after and before - (after[0] - 1) <= 1, (before, after[:3])
    assert {e["restarts"] for e in seen} == {"0"}
    assert any(e["event"] == "done" and e["step"] == 40 for e in seen)
